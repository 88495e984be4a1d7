"""Notebook 04 on a CUDA GPU: the torch backend (the reference for GPU kernels) at Qwen3-0.6B head shapes, and
the "auto" backend choice. No hypothesis needed, so these run on a bare GPU machine."""
import pytest
import torch
from attention_helpers import PagedSetup, cu, attn_step

from nanovllm_edu.layers.backends.base import AttentionBackend
from nanovllm_edu.layers.backends import triton_backend  # noqa: F401  (registers notebook 12's backend for "auto")
from nanovllm_edu.layers.backends.registry import get_attention_backend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend

torch.set_grad_enabled(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("block_size", [16, 256])
def test_torch_backend_on_gpu(dtype, tol, block_size):
    """The reference GPU kernels are checked against must itself be right on CUDA (Qwen3-0.6B head shapes)."""
    lengths, cached = [300, 17, 1, 600], [256, 0, 0, 300]
    s = PagedSetup(lengths, block_size, 16, 8, head_dim=128, seed=5, device="cuda", dtype=dtype)
    backend = TorchBackend()
    s.store_all(backend)
    new = [n - c for n, c in zip(lengths, cached)]
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(new).cuda(), cu_seqlens_k=cu(lengths).cuda(), max_seqlen_q=max(new),
                  max_seqlen_k=max(lengths), block_tables=s.block_tables)
    q = torch.cat([x[c:] for x, c in zip(s.q, cached)])
    k = torch.cat([x[c:] for x, c in zip(s.k, cached)])
    v = torch.cat([x[c:] for x, c in zip(s.v, cached)])
    out = backend.prefill(q, k, v, s.k_cache, s.v_cache, ctx, s.scale)
    expected = torch.cat([e[c:] for e, c in zip(s.expected, cached)])
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(lengths).cuda(), cu_seqlens_k=cu(lengths).cuda(),
                  max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    out = backend.prefill(torch.cat(s.q), torch.cat(s.k), torch.cat(s.v), s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out.float(), torch.cat(s.expected), atol=tol, rtol=tol)
    ctx = attn_step(is_prefill=False, context_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                  block_tables=s.block_tables, max_seqlen_k=max(lengths))
    out = backend.decode(torch.stack([x[-1] for x in s.q]), s.k_cache, s.v_cache, ctx, s.scale)
    torch.testing.assert_close(out.float(), torch.stack([e[-1] for e in s.expected]), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_backend_on_gpu_is_not_torch():
    backend = get_attention_backend("auto", torch.device("cuda"))
    assert isinstance(backend, AttentionBackend) and backend.name in ("triton", "flash_attn")
