"""The model registry (notebook 02): config.json's model_type picks the family the engine builds; Config
(notebook 01) refuses a model_type nobody registered, by name, listing the registered ones."""
import json

import pytest

import nanovllm_edu.llm  # noqa: F401  (imports every registered family, as TP workers do)
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import MODEL_TYPES, Config
from nanovllm_edu.llm import LLM
from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM
from nanovllm_edu.models.registry import (MODEL_REGISTRY, ModelFamily, load_pretrained, model_family,
                                          register_model)
from nanovllm_edu.sampling_params import SamplingParams
from nanovllm_edu.utils.loader import load_model


@pytest.fixture
def registry():
    """Restore the registry and Config's names after a test registers a family."""
    saved, names = dict(MODEL_REGISTRY), set(MODEL_TYPES)
    yield
    MODEL_REGISTRY.clear(), MODEL_REGISTRY.update(saved)
    MODEL_TYPES.clear(), MODEL_TYPES.update(names)


def test_config_accepts_exactly_the_registered_model_types():
    assert set(MODEL_REGISTRY) == MODEL_TYPES == {"qwen3"}
    assert model_family("qwen3") == ModelFamily(Qwen3ForCausalLM, load_model)


def test_an_unregistered_model_type_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="'llama' checkpoint; nanovllm-edu supports model_type 'qwen3'.*register_model"):
        Config(str(tmp_path))
    with pytest.raises(ValueError, match="model_type 'llama' is not registered; registered: 'qwen3'"):
        model_family("llama")


def test_registering_a_family_makes_config_accept_it(tmp_path, registry):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    register_model("llama", ModelFamily(Qwen3ForCausalLM, load_model))
    assert Config(str(tmp_path)).hf_config.model_type == "llama"  # transformers fills in the rest
    assert model_family("llama").model_class is Qwen3ForCausalLM


def test_register_model_refuses_a_bare_class(registry):
    with pytest.raises(TypeError, match="ModelFamily"):
        register_model("qwen3", Qwen3ForCausalLM)


def test_the_engine_builds_the_registered_family(registry):
    loads = []

    def counting_loader(model, path):
        loads.append(type(model).__name__)
        load_model(model, path)

    register_model("qwen3", ModelFamily(Qwen3ForCausalLM, counting_loader))
    llm = LLM(str(tiny_model_path()), device="cpu", max_model_len=128)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    finally:
        llm.exit()
    assert loads == ["Qwen3ForCausalLM"] and len(out[0]["token_ids"]) == 3


def test_load_pretrained_matches_from_pretrained():
    import torch
    ids = torch.tensor([3, 14, 15, 92, 65])
    built = load_pretrained(tiny_model_path())
    assert torch.equal(built.logits(ids), Qwen3ForCausalLM.from_pretrained(tiny_model_path()).logits(ids))
