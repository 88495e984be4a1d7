"""The flash-attn backend's contract, with the flash-attn library replaced by a recorder (it needs a GPU
and is optional; the benchmark machine has none)."""
import importlib.machinery
import sys
import types

import pytest
import torch

from attention_helpers import attn_step
from nanovllm_edu.layers.backends import flash_attn_backend  # noqa: F401  (registers it)
from nanovllm_edu.layers.backends.registry import get_attention_backend


@pytest.fixture
def flash_calls(monkeypatch):
    """Install a fake `flash_attn` module whose two functions record their arguments."""
    calls = {}
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)

    def flash_attn_varlen_func(q, k, v, **kwargs):
        calls["varlen"] = (q, k, v, kwargs)
        return torch.full_like(q, 1.0)

    def flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs):
        calls["kvcache"] = (q, k_cache, v_cache, kwargs)
        return torch.full_like(q, 2.0)

    fake.flash_attn_varlen_func = flash_attn_varlen_func
    fake.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    return calls


def test_needs_the_package():
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ImportError, match="flash-attn"):
        get_attention_backend("flash_attn", "cuda", 256)


def test_block_size_must_be_a_multiple_of_256(flash_calls):
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attention_backend("flash_attn", "cuda", 16)
    assert get_attention_backend("flash_attn", "cuda", 512).name == "flash_attn"


def test_auto_never_picks_flash_attn_on_cpu_or_with_small_blocks(flash_calls):
    assert get_attention_backend("auto", "cpu", 256).name == "torch"


def test_prefill_and_decode_arguments(flash_calls):
    backend = get_attention_backend("flash_attn", "cuda", 256)
    q, k, v = torch.randn(7, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    k_cache, v_cache = torch.zeros(3, 256, 2, 16), torch.zeros(3, 256, 2, 16)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=4, max_seqlen_k=4)
    out = backend.prefill(q, k, v, k_cache, v_cache, ctx, 0.25)
    got_q, got_k, _, kwargs = flash_calls["varlen"]
    assert got_k is k and kwargs["block_table"] is None and kwargs["causal"] and kwargs["softmax_scale"] == 0.25
    assert out.shape == q.shape

    tables = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 300, 304], dtype=torch.int32),
                  max_seqlen_q=4, max_seqlen_k=300, block_tables=tables)
    backend.prefill(q, k, v, k_cache, v_cache, ctx, 0.25)
    _, got_k, got_v, kwargs = flash_calls["varlen"]
    assert got_k is k_cache and got_v is v_cache and kwargs["block_table"] is tables and kwargs["max_seqlen_k"] == 300

    lens = torch.tensor([300, 4], dtype=torch.int32)
    out = backend.decode(torch.randn(2, 4, 16), k_cache, v_cache, attn_step(context_lens=lens, block_tables=tables), 0.25)
    got_q, _, _, kwargs = flash_calls["kvcache"]
    assert got_q.shape == (2, 1, 4, 16) and kwargs["cache_seqlens"] is lens and kwargs["block_table"] is tables
    assert out.shape == (2, 4, 16) and torch.all(out == 2.0)
