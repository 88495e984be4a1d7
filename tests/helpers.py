"""Shared test helpers: random Qwen3 checkpoints written by transformers itself.

Random weights from transformers' own initialisation are tiny, so every logit is nearly the same and
greedy choices are near-ties that flip with rounding. These helpers spread the weights instead (std
`std_scale / sqrt(fan_in)` for matrices, norm gains in [0.5, 1.5]) so that outputs are well separated
and a wrong computation shows up as a large difference.
"""
import math
import signal
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def spread_init_(model: torch.nn.Module, std_scale: float = 4.0, seed: int = 0) -> torch.nn.Module:
    "Re-initialise in place: matrices N(0, std_scale/sqrt(fan_in)), vectors (norm gains, biases) U[0.5, 1.5]."
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std_scale / math.sqrt(p.shape[1]))
    return model


def random_qwen3_config(*, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, head_dim: int = 16, vocab_size: int = 256,
                        tie_word_embeddings: bool = True, intermediate_size: int | None = None,
                        max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                        **config_kwargs) -> Qwen3Config:
    "A small Qwen3Config; the last token id is bos/eos/pad. Extra keyword arguments go to Qwen3Config."
    eos = vocab_size - 1
    kwargs = {
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings, "rope_theta": rope_theta, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings, "bos_token_id": eos, "eos_token_id": eos,
        "pad_token_id": eos,
    }
    kwargs.update(config_kwargs)
    return Qwen3Config(**kwargs)


def make_random_hf_qwen3(*, std_scale: float = 4.0, seed: int = 0, dtype: torch.dtype = torch.float32,
                         **config_kwargs) -> Qwen3ForCausalLM:
    "A transformers Qwen3ForCausalLM with spread random weights (shape arguments: `random_qwen3_config`)."
    model = Qwen3ForCausalLM(random_qwen3_config(**config_kwargs)).eval()
    spread_init_(model, std_scale=std_scale, seed=seed)
    return model.to(dtype)


def make_random_qwen3_checkpoint(path: str | Path, *, hidden_size: int = 64, num_layers: int = 2,
                                 num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                                 vocab_size: int = 256, tie_word_embeddings: bool = True,
                                 dtype: torch.dtype = torch.float32, std_scale: float = 4.0, seed: int = 0,
                                 **config_kwargs) -> Path:
    """Write a random Qwen3 checkpoint (config.json + *.safetensors, no tokenizer) with transformers'
    `save_pretrained` into `path` and return the folder. Extra keyword arguments go to Qwen3Config
    (e.g. `intermediate_size`, `max_position_embeddings`, `attention_bias`); `max_shard_size="100KB"`
    splits the weights over several files."""
    max_shard_size = config_kwargs.pop("max_shard_size", None)
    model = make_random_hf_qwen3(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim, vocab_size=vocab_size,
                                 tie_word_embeddings=tie_word_embeddings, std_scale=std_scale, seed=seed,
                                 dtype=dtype, **config_kwargs)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def generate_counting_ahead(llm, prompts, params):
    """llm.generate, also returning how many steps were launched ahead of the previous step's tokens."""
    count = {"ahead": 0}
    original = llm.scheduler.can_schedule_ahead

    def counted():
        ok = original()
        count["ahead"] += ok
        return ok

    llm.scheduler.can_schedule_ahead = counted
    try:
        return llm.generate(prompts, params, use_tqdm=False), count["ahead"]
    finally:
        del llm.scheduler.can_schedule_ahead


def without_metrics(results: list[dict]) -> list[dict]:
    """Results without their `metrics` (times differ between any two runs): for comparing two runs' outputs."""
    return [{k: v for k, v in result.items() if k != "metrics"} for result in results]


# two layer shapes: GQA ratio 2 with head_dim 16, GQA ratio 3 with head_dim 32 (and head_dim != hidden/heads)
LAYER_SHAPES = [{"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
                {"hidden_size": 96, "num_heads": 6, "num_kv_heads": 2, "head_dim": 32}]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    "Same shape, and the largest difference at most `rtol` times the reference's largest magnitude."
    assert ours.shape == ref.shape
    diff, scale = (ours.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert diff <= rtol * scale, f"max |diff| {diff:.3g} > {rtol:g} x {scale:.3g}"


def random_tokens(hf, T: int = 9, seed: int = 0) -> torch.Tensor:
    "T random hidden states [T, hidden] for the transformers model `hf`."
    return torch.randn(T, hf.config.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=LAYER_SHAPES, ids=["gqa2-d16", "gqa3-d32"])
def hf(request):
    "A one-layer transformers Qwen3 of each layer shape (import it into a test module to use it)."
    return make_random_hf_qwen3(**request.param, num_layers=1, seed=1)


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handler for the test (restored afterwards). The engine defers a Ctrl-C only under it
    (`DeferredInterrupt`), and a child process inherits an ignored SIGINT; in a full local run of the suite
    (tests, then every notebook) the Ctrl-C tests found another handler in place and failed."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)
