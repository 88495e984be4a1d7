"""Notebook 02: the whole model against transformers' Qwen3ForCausalLM on checkpoints that transformers
wrote itself (random ones of several shapes, and the shipped tiny model), plus the loader and
`from_pretrained` contract."""
import json
from pathlib import Path

import pytest
import torch
from helpers import make_random_qwen3_checkpoint
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.layers.attention import Attention
from nanovllm_edu.layers.backends.base import attach_kv_cache
from nanovllm_edu.models.qwen3 import Qwen3ForCausalLM
from nanovllm_edu.utils.loader import checkpoint_dtype, load_model

torch.set_grad_enabled(False)

# (name, shape): GQA ratios 2 and 3, head_dim 16 and 32, tied and untied heads
CHECKPOINTS = {
    "gqa2-d16-tied": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                      "vocab_size": 256, "tie_word_embeddings": True},
    "gqa3-d32-untied": {"hidden_size": 96, "num_layers": 3, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32,
                        "vocab_size": 320, "tie_word_embeddings": False},
}


def max_rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def hf_from(path: Path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


def greedy(logits_fn, ids: torch.Tensor, n: int, eos_id: int | None = None) -> list[int]:
    for _ in range(n):
        ids = torch.cat([ids, logits_fn(ids)[-1].argmax()[None]])
        if ids[-1].item() == eos_id:
            break
    return ids.tolist()


@pytest.fixture(scope="module", params=list(CHECKPOINTS), ids=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_random_qwen3_checkpoint(path, **CHECKPOINTS[request.param], seed=7)


def test_logits_match_transformers(checkpoint):
    ours, ref = Qwen3ForCausalLM.from_pretrained(checkpoint), hf_from(checkpoint)
    vocab = ref.config.vocab_size
    ids = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0))
    logits = ours.logits(ids)
    assert logits.shape == (40, vocab)
    assert max_rel_diff(logits, ref(ids[None]).logits[0]) <= 1e-4


def test_greedy_tokens_match_transformers(checkpoint):
    ours, ref = Qwen3ForCausalLM.from_pretrained(checkpoint), hf_from(checkpoint)
    prompt = torch.tensor([1, 2, 3, 4, 5])
    assert greedy(ours.logits, prompt, 12) == greedy(lambda ids: ref(ids[None]).logits[0], prompt, 12)


def test_flattened_forward_and_compute_logits(checkpoint):
    model = Qwen3ForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    hidden = model(ids, torch.arange(len(ids)))
    assert hidden.shape == (len(ids), model.config.hidden_size)
    last = model.compute_logits(hidden[[-1]])  # the engine scores only the rows it samples from
    assert last.shape == (1, model.config.vocab_size)
    assert torch.allclose(last[0], model.logits(ids)[-1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        model.logits(ids[None])


def test_tied_and_untied_heads(checkpoint):
    model = Qwen3ForCausalLM.from_pretrained(checkpoint)
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        names = set(f.keys())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in names  # transformers stores a tied head once
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert "lm_head.weight" in names
        with safe_open(checkpoint / "model.safetensors", "pt") as f:
            assert torch.equal(model.lm_head.weight, f.get_tensor("lm_head.weight"))


def test_packed_weights_are_the_checkpoint_tensors(checkpoint):
    model = Qwen3ForCausalLM.from_pretrained(checkpoint)
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        get = f.get_tensor
        p = "model.layers.1."
        qkv = torch.cat([get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                         get(p + "self_attn.v_proj.weight")])
        gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        layer = model.model.layers[1]
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.self_attn.q_norm.weight, get(p + "self_attn.q_norm.weight"))


def test_attention_modules_are_where_the_runner_looks(checkpoint):
    model = Qwen3ForCausalLM.from_pretrained(checkpoint)
    for layer in model.model.layers:
        assert type(layer.self_attn.attn) is Attention  # plain: no cache until the engine attaches one


def test_logits_ignore_a_backend(checkpoint):
    "model.logits is plain causal attention even after a runner has attached a backend and a cache."
    class Exploding:
        name = "exploding"

        def __getattr__(self, item):
            raise AssertionError("backend used by model.logits")

    model = Qwen3ForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([5, 6, 7, 8])
    expected = model.logits(ids)
    backend = Exploding()
    attach_kv_cache(model, torch.zeros(2, len(model.model.layers), 1, 16, 2, 16), backend)
    assert torch.equal(model.logits(ids), expected)
    assert all(layer.self_attn.attn.backend is backend for layer in model.model.layers)


def test_bf16_checkpoint(tmp_path):
    path = make_random_qwen3_checkpoint(tmp_path, **CHECKPOINTS["gqa3-d32-untied"], dtype=torch.bfloat16,
                                        seed=3)
    assert json.loads((path / "config.json").read_text()).get("dtype") == "bfloat16"
    model = Qwen3ForCausalLM.from_pretrained(path)  # the checkpoint's dtype by default
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32  # angles keep their digits
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(1))
    ref32 = hf_from(path, torch.float32)(ids[None]).logits[0]
    # the same bf16 weights computed in float32: exact parity
    model32 = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model32.parameters())
    assert max_rel_diff(model32.logits(ids), ref32) <= 1e-4
    # computed in bf16: bf16 rounding, no worse than transformers' own bf16 run
    ours16, ref16 = model.logits(ids), hf_from(path, torch.bfloat16)(ids[None]).logits[0]
    assert ours16.dtype == torch.bfloat16
    assert max_rel_diff(ours16, ref32) <= max(0.05, 2 * max_rel_diff(ref16, ref32))


def test_fp32_checkpoint_loads_as_bf16(tmp_path):
    path = make_random_qwen3_checkpoint(tmp_path, seed=4)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert checkpoint_dtype(model.config) == torch.float32


def test_sharded_checkpoint_reads_every_file(tmp_path):
    path = make_random_qwen3_checkpoint(tmp_path, seed=5, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    ids = torch.arange(10)
    ours = Qwen3ForCausalLM.from_pretrained(path).logits(ids)
    assert max_rel_diff(ours, hf_from(path)(ids[None]).logits[0]) <= 1e-4


def test_attention_bias_checkpoint(tmp_path):
    "attention_bias=True puts biases on q/k/v/o: the packed loaders must place them too."
    path = make_random_qwen3_checkpoint(tmp_path, seed=6, attention_bias=True)
    model = Qwen3ForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    ids = torch.arange(12)
    assert max_rel_diff(model.logits(ids), hf_from(path)(ids[None]).logits[0]) <= 1e-4


def test_untied_config_without_lm_head_fails_loudly(tmp_path):
    path = make_random_qwen3_checkpoint(tmp_path, seed=8, tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lm_head.weight"):
        Qwen3ForCausalLM.from_pretrained(path)


def test_from_pretrained_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model folder"):
        Qwen3ForCausalLM.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Qwen3ForCausalLM.from_pretrained(tmp_path)
    path = make_random_qwen3_checkpoint(tmp_path / "ckpt", seed=9)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        Qwen3ForCausalLM.from_pretrained(path)
    with pytest.raises(FileNotFoundError, match="safetensors"):  # load_model alone says why too
        load_model(torch.nn.Linear(1, 1), tmp_path)


# ---- the shipped tiny model ----

TINY = Path(tiny_model_path())
needs_tiny = pytest.mark.skipif(
    not (TINY / "model.safetensors").is_file(),
    reason=f"the tiny model is not in {TINY} yet (scripts/train_tiny_model.py writes it)")


@needs_tiny
def test_tiny_model_files():
    config = json.loads((TINY / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    tokenizer = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    vocab = tokenizer.get_vocab()
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        assert token in vocab and len(tokenizer.encode(token)) == 1, token
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
    size = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert size <= 16 * 2**20, f"tiny model folder is {size / 2**20:.1f} MB"


@needs_tiny
def test_tiny_model_parity():
    tokenizer = AutoTokenizer.from_pretrained(TINY, local_files_only=True)
    ours, ref = Qwen3ForCausalLM.from_pretrained(TINY), hf_from(TINY)
    ids = torch.tensor(tokenizer.encode("Return the number of items in the container."))
    assert max_rel_diff(ours.logits(ids), ref(ids[None]).logits[0]) <= 1e-4
    eos = tokenizer.eos_token_id
    assert greedy(ours.logits, ids, 16, eos) == greedy(lambda x: ref(x[None]).logits[0], ids, 16, eos)
