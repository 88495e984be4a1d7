"""Issue 12: loading is safe from two threads, and a checkpoint whose config and weights disagree, or whose
weights are not finite, is refused by name at load (notebook 02: utils/loader.py, models/qwen3.py)."""
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm_edu.models import qwen3
from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM
from nanovllm_edu.utils import loader
from nanovllm_edu.utils.loader import load_weights

from helpers import make_random_qwen3_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {dtype: make_random_qwen3_checkpoint(root / str(dtype), dtype=dtype)
            for dtype in (torch.float32, torch.bfloat16)}


def load_in_two_threads(checkpoints, monkeypatch):
    """Load both checkpoints at once; a slow step in the middle of construction makes the two overlap."""
    make_rope = qwen3.make_rope

    def slow_make_rope(hf_config):  # called by Qwen3Model.__init__ between the embedding and the layers
        time.sleep(0.2)
        return make_rope(hf_config)
    monkeypatch.setattr(qwen3, "make_rope", slow_make_rope)
    models, errors = {}, []

    def load(dtype):
        try:
            models[dtype] = Qwen3ForCausalLM.from_pretrained(checkpoints[dtype])
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
    threads = [threading.Thread(target=load, args=(dtype,)) for dtype in checkpoints]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the second starts while the first is inside its construction
    for t in threads:
        t.join()
    assert not errors, errors
    return {dtype: {p.dtype for p in model.parameters()} for dtype, model in models.items()}


def test_two_threads_load_float32_and_bfloat16_each_in_its_own_dtype(checkpoints, monkeypatch):
    dtypes = load_in_two_threads(checkpoints, monkeypatch)
    assert dtypes == {torch.float32: {torch.float32}, torch.bfloat16: {torch.bfloat16}}
    assert torch.get_default_dtype() == torch.float32


def test_without_the_lock_the_race_is_real(checkpoints, monkeypatch):
    """The control: with the lock replaced by a no-op the same race mixes dtypes, so the test above can fail."""
    class NoLock:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(loader, "DEFAULT_DTYPE_LOCK", NoLock())
    try:
        dtypes = load_in_two_threads(checkpoints, monkeypatch)
    finally:
        torch.set_default_dtype(torch.float32)
    assert dtypes != {torch.float32: {torch.float32}, torch.bfloat16: {torch.bfloat16}}


@pytest.fixture
def checkpoint(tmp_path):
    return make_random_qwen3_checkpoint(tmp_path / "ckpt")  # 2 layers, vocab 256, hidden 64


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    if "num_hidden_layers" in changes and "layer_types" in config:  # transformers checks the two agree
        config["layer_types"] = config["layer_types"][:1] * changes["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, match", [
    (dict(num_hidden_layers=1), r"the weights hold 2 decoder layers .*model\.layers\.1\) but config\.json says "
                                r"num_hidden_layers=1; config\.json and the weights .* must come from the same model"),
    (dict(num_hidden_layers=3), r"the weights hold 2 decoder layers .* num_hidden_layers=3"),
    (dict(vocab_size=300), r"tensor 'model\.embed_tokens\.weight' has shape \(256, 64\), i\.e\. vocab_size 256, "
                           r"but config\.json says vocab_size=300"),
    (dict(vocab_size=200), r"'model\.embed_tokens\.weight'.*vocab_size 256.*vocab_size=200"),
    (dict(hidden_size=32), r"'model\.embed_tokens\.weight' has shape \(256, 64\), i\.e\. hidden_size 64, "
                           r"but config\.json says hidden_size=32"),
])
def test_config_that_disagrees_with_the_weights_is_refused_by_name(checkpoint, changes, match):
    edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=match):
        Qwen3ForCausalLM.from_pretrained(checkpoint)


def test_a_tensor_with_no_parameter_is_named_by_the_loader(checkpoint):
    """The loader's own fallback (for callers that skip from_pretrained's check): no raw AttributeError."""
    config = Qwen3ForCausalLM.from_pretrained(checkpoint).config
    config.num_hidden_layers = 1
    model = Qwen3ForCausalLM(config)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.1\..*' has no parameter"):
        load_weights(model, load_file(checkpoint / "model.safetensors").items())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_with_the_tensor_name(checkpoint, value):
    file = checkpoint / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.1\.mlp\.down_proj\.weight' has 1 "
                                         r"non-finite values \(NaN or inf\) of 8192"):
        Qwen3ForCausalLM.from_pretrained(checkpoint)


def test_finite_bfloat16_and_integer_tensors_pass_the_check():
    loader.check_finite("w", torch.randn(64, 64).to(torch.bfloat16))
    loader.check_finite("ids", torch.arange(10))
    loader.check_finite("empty", torch.empty(0))


def test_a_model_path_that_is_a_file_says_so(checkpoint):
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors is a file, not a model folder"):
        Qwen3ForCausalLM.from_pretrained(checkpoint / "model.safetensors")
