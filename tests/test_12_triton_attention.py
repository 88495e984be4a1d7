"""Notebook 12: Triton paged attention (decode with flash-decoding, varlen prefill) against a torch reference.

On CPU the kernels run in Triton's interpreter, so these cases are tiny; the `gpu` tests cover real shapes.
"""
import nanovllm_edu  # noqa: F401  (first: sets TRITON_INTERPRET=1 when there is no CUDA GPU)
import pytest
import torch

pytest.importorskip("triton")

from attention_helpers import attn_step
from nanovllm_edu.layers.backends.triton_backend import TritonBackend
from nanovllm_edu.kernels.paged_attention import (decode_num_splits, paged_decode,
                                                  varlen_prefill)
from nanovllm_edu.kernels.store_kvcache import store_kvcache_torch
from nanovllm_edu.layers.backends.base import AttentionBackend
from nanovllm_edu.layers.backends.torch_backend import TorchBackend

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the small cases run compiled on a GPU machine
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- reference and fixtures
def reference_attention(q, k, v, scale, q_offset):
    """One sequence, float32: q [Lq, H, D], k/v [Lk, KVH, D]; query i at position q_offset + i; causal."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    pos_q = q_offset + torch.arange(q.shape[0], device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def gather_context(cache, block_table, length):
    pos = torch.arange(length, device=cache.device)
    return cache[block_table[pos // cache.shape[1]].long(), pos % cache.shape[1]]


def paged_cache(context_lens, block_size, kv_heads, head_dim, dtype, device="cpu", spare_blocks=3, seed=0):
    """Random caches; each sequence gets shuffled blocks; tables padded with -1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.full((len(context_lens), max(need)), -1, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    return k_cache, v_cache, tables


def decode_reference(q, k_cache, v_cache, tables, context_lens, scale):
    return torch.stack([reference_attention(q[b:b + 1], gather_context(k_cache, tables[b], n),
                                            gather_context(v_cache, tables[b], n), scale, n - 1)[0]
                        for b, n in enumerate(context_lens)])


def prefill_case(q_lens, prefixes, block_size, heads, kv_heads, head_dim, dtype, device="cpu", seed=0):
    """q/k/v of the new tokens, caches holding prefix + new tokens, and the step's Context."""
    torch.manual_seed(seed)
    ctx_lens = [p + n for p, n in zip(prefixes, q_lens)]
    k_cache, v_cache, tables = paged_cache(ctx_lens, block_size, kv_heads, head_dim, dtype, device, seed=seed)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, device=device).to(dtype)
    k = torch.randn(T, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(T, kv_heads, head_dim, device=device).to(dtype)
    slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size
                          for b in range(len(q_lens)) for p in range(prefixes[b], ctx_lens[b])], device=device)
    store_kvcache_torch(k, v, k_cache, v_cache, slots)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    paged = any(prefixes)
    ctx = attn_step(is_prefill=True, cu_seqlens_q=cu(q_lens), cu_seqlens_k=cu(ctx_lens), max_seqlen_q=max(q_lens),
                  max_seqlen_k=max(ctx_lens), slot_mapping=slots, block_tables=tables if paged else None)
    return q, k, v, k_cache, v_cache, ctx, ctx_lens


def prefill_reference(q, k, v, k_cache, v_cache, ctx, ctx_lens, q_lens, prefixes, scale):
    outs, start = [], 0
    for b, n in enumerate(q_lens):
        rows = slice(start, start + n)
        if ctx.block_tables is not None:
            kb = gather_context(k_cache, ctx.block_tables[b], ctx_lens[b])
            vb = gather_context(v_cache, ctx.block_tables[b], ctx_lens[b])
        else:
            kb, vb = k[rows], v[rows]
        outs.append(reference_attention(q[rows], kb, vb, scale, prefixes[b]))
        start += n
    return torch.cat(outs)


# ---------------------------------------------------------------- CPU (interpreter), tiny shapes
@pytest.mark.parametrize("block_size,num_splits,block_n", [(16, 1, None), (32, 3, None), (16, 2, 32)])
def test_decode_matches_reference_fp32(block_size, num_splits, block_n):
    lens = [1, 17, 40, 70]
    k_cache, v_cache, tables = paged_cache(lens, block_size, kv_heads=2, head_dim=16, dtype=torch.float32, device=DEV)
    q = torch.randn(len(lens), 4, 16, device=DEV)  # GQA: 2 query heads per KV head
    out = paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV), 0.25,
                       num_splits=num_splits, block_n=block_n)
    torch.testing.assert_close(out, decode_reference(q, k_cache, v_cache, tables, lens, 0.25), atol=1e-4, rtol=0)


def test_decode_bf16_and_empty_sequence():
    lens = [33, 0]  # a zero-length row, as in a padded CUDA-graph batch, must give zeros (no NaN)
    k_cache, v_cache, tables = paged_cache([33, 1], 16, kv_heads=1, head_dim=32, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(2, 2, 32, device=DEV).to(torch.bfloat16)
    out = paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV), 0.2,
                       num_splits=2)
    ref = decode_reference(q[:1], k_cache, v_cache, tables[:1], lens[:1], 0.2)
    torch.testing.assert_close(out[:1].float(), ref, atol=2e-2, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("prefixes,block_size,tiles", [((0, 0, 0), 16, (None, None)), ((0, 16, 3), 16, (None, None)),
                                                        ((5, 0, 40), 32, (32, 16)), ((7, 2, 0), 16, (16, 32))])
def test_prefill_matches_reference_fp32(prefixes, block_size, tiles):
    q_lens = [5, 20, 33]
    q, k, v, k_cache, v_cache, ctx, ctx_lens = prefill_case(q_lens, prefixes, block_size, 4, 2, 16, torch.float32, DEV)
    cu_k = ctx.cu_seqlens_k if ctx.block_tables is not None else ctx.cu_seqlens_q
    out = varlen_prefill(q, k, v, k_cache, v_cache, ctx.cu_seqlens_q, cu_k, ctx.max_seqlen_q, ctx.block_tables,
                         0.25, block_m=tiles[0], block_n=tiles[1])
    ref = prefill_reference(q, k, v, k_cache, v_cache, ctx, ctx_lens, q_lens, prefixes, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_prefill_strided_qkv_without_prefix():
    """k and v sliced out of one fused projection (non-contiguous), as the model passes them."""
    T, heads, kv_heads, d = 24, 4, 2, 16
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, device=DEV)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = q.view(T, heads, d), k.view(T, kv_heads, d), v.view(T, kv_heads, d)
    assert not k.is_contiguous()
    cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=DEV)
    out = varlen_prefill(q, k, v, torch.empty(0), torch.empty(0), cu, cu, 14, None, 0.25)
    ref = torch.cat([reference_attention(q[a:b], k[a:b], v[a:b], 0.25, 0) for a, b in ((0, 10), (10, 24))])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_backend_matches_torch_backend():
    backend = TritonBackend()
    assert isinstance(backend, AttentionBackend) and backend.name == "triton"
    q_lens, prefixes = [7, 12], [0, 20]
    q, k, v, k_cache, v_cache, ctx, ctx_lens = prefill_case(q_lens, prefixes, 16, 4, 2, 32, torch.float32, DEV, seed=1)
    # store: both backends write identical caches
    kc_t, vc_t, kc_r, vc_r = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    k2, v2 = torch.randn_like(k), torch.randn_like(v)
    backend.store_kvcache(k2, v2, kc_t, vc_t, ctx.slot_mapping)
    TorchBackend().store_kvcache(k2, v2, kc_r, vc_r, ctx.slot_mapping)
    assert torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r)
    # prefill with a cached prefix
    torch.testing.assert_close(backend.prefill(q, k, v, k_cache, v_cache, ctx, 0.2),
                               TorchBackend().prefill(q, k, v, k_cache, v_cache, ctx, 0.2), atol=1e-4, rtol=0)
    # decode
    dctx = attn_step(is_prefill=False, context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=DEV),
                   block_tables=ctx.block_tables, max_seqlen_k=max(ctx_lens))
    q1 = torch.randn(2, 4, 32, device=DEV)
    torch.testing.assert_close(backend.decode(q1, k_cache, v_cache, dctx, 0.2),
                               TorchBackend().decode(q1, k_cache, v_cache, dctx, 0.2), atol=1e-4, rtol=0)


def test_decode_refuses_more_rows_than_the_grid_holds():
    """Rows are the grid's second axis (CUDA allows 65,535 there): refused before any launch."""
    q = torch.zeros(65536, 2, 16)
    k_cache = torch.zeros(1, 16, 1, 16)
    with pytest.raises(AssertionError, match="65,535 sequences"):
        paged_decode(q, k_cache, k_cache, torch.zeros(65536, 1, dtype=torch.int32),
                     torch.ones(65536, dtype=torch.int32), 0.25)


def test_decode_num_splits_uses_shapes_sensibly():
    assert decode_num_splits(512, 8, 4096) == 1  # the biggest batches fill the GPU unsplit
    assert decode_num_splits(256, 8, 4096) == 1  # the benchmark's batch, longest rows first: one split
    assert decode_num_splits(128, 8, 4096) == 1  # 8 programs per SM (figures/sweep_attention_h200.json)
    assert decode_num_splits(64, 8, 4096) == 2
    assert decode_num_splits(1, 8, 4096) > 8  # one long sequence is split
    assert decode_num_splits(1, 8, 64) == 1  # never a partition under 64 tokens
    counts = [decode_num_splits(b, 8, 4096) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert counts == sorted(counts, reverse=True) and all(1 <= c <= 32 for c in counts)


# ---------------------------------------------------------------- GPU
GPU_DECODE_CASES = [  # (batch, max context, block size)
    (1, 1, 16), (1, 4096, 16), (1, 4096, 256), (3, 2000, 32), (7, 1000, 64), (33, 700, 128),
    (64, 4096, 256), (256, 1, 256), (256, 300, 16), (256, 1500, 256),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,max_context,block_size", GPU_DECODE_CASES)
def test_gpu_decode(dtype, batch, max_context, block_size):
    gen = torch.Generator().manual_seed(batch * 7919 + max_context)
    lens = torch.randint(1, max_context + 1, (batch,), generator=gen).tolist()
    lens[0] = max_context
    k_cache, v_cache, tables = paged_cache(lens, block_size, 8, 128, dtype, device="cuda")
    q = torch.randn(batch, 16, 128, device="cuda").to(dtype)
    out = paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"), 128 ** -0.5)
    # a batched reference: gather every context padded to max_context, mask the tail
    pos = torch.arange(max_context, device="cuda")
    blocks = tables[:, pos // block_size].long().clamp(min=0)
    kf, vf = (c[blocks, pos % block_size].float().repeat_interleave(2, 2) for c in (k_cache, v_cache))
    scores = torch.einsum("bhd,blhd->bhl", q.float(), kf) * 128 ** -0.5
    scores = scores.masked_fill(pos[None, None, :] >= torch.tensor(lens, device="cuda")[:, None, None], float("-inf"))
    ref = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), vf)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_prefill(dtype, block_size, with_prefix, head_dim):
    q_lens = [1, 37, 300, 1024, 129]
    prefixes = [5, 0, 700, 256, 3000] if with_prefix else [0] * 5
    q, k, v, k_cache, v_cache, ctx, ctx_lens = prefill_case(q_lens, prefixes, block_size, 16, 4, head_dim, dtype,
                                                            device="cuda")
    out = TritonBackend().prefill(q, k, v, k_cache, v_cache, ctx, head_dim ** -0.5)
    ref = prefill_reference(q, k, v, k_cache, v_cache, ctx, ctx_lens, q_lens, prefixes, head_dim ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=0)


@gpu
@needs_cuda
def test_gpu_decode_cuda_graph_replay_with_new_lengths():
    """Captured once (fresh compile included), replayed with new context lengths, queries and tables."""
    batch, width, block_size = 4, 4096 // 16, 16
    k_cache, v_cache, tables = paged_cache([4096] * batch, block_size, 8, 128, torch.bfloat16, device="cuda")
    lens = torch.tensor([3000, 10, 500, 1], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16)
    assert tables.shape[1] == width
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TritonBackend().decode(q, k_cache, v_cache, attn_step(context_lens=lens, block_tables=tables), 0.088)
    for new_lens in ([2999, 11, 1, 400], [1, 4096, 17, 2048]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.normal_()
        tables.copy_(tables.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_reference(q, k_cache, v_cache, tables, new_lens, 0.088)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
