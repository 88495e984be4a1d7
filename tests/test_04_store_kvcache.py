"""Notebook 04: the KV store kernel (Triton, run by the interpreter on CPU) against the PyTorch path."""
import nanovllm_edu  # noqa: F401  (first: sets TRITON_INTERPRET=1 when there is no CUDA GPU)
import pytest
import torch

from nanovllm_edu.kernels.store_kvcache import (HAS_TRITON, get_store_kvcache, store_kvcache,
                                               store_kvcache_torch)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the small cases run compiled on a GPU machine
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fused_kv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device=DEV):
    """k, v as strided views of one fused qkv projection output, as the model produces them."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device=DEV, num_layers=2):
    return torch.randn(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)


def test_torch_path_places_rows_at_slots():
    block_size = 4
    cache = torch.zeros(2, 1, 3, block_size, 2, 8, device=DEV)
    key, value = torch.randn(3, 2, 8, device=DEV), torch.randn(3, 2, 8, device=DEV)
    slots = torch.tensor([9, -1, 2], device=DEV)  # block 2 offset 1; skipped; block 0 offset 2
    store_kvcache_torch(key, value, cache[0, 0], cache[1, 0], slots)
    assert torch.equal(cache[0, 0, 2, 1], key[0]) and torch.equal(cache[1, 0, 2, 1], value[0])
    assert torch.equal(cache[0, 0, 0, 2], key[2]) and torch.equal(cache[1, 0, 0, 2], value[2])
    assert int((cache != 0).any(-1).any(-1).sum()) == 4  # two slots in K, two in V, nothing else


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_torch_bitwise_on_strided_qkv(dtype):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 16, 2, 16, 20
    cache = random_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    k, v = fused_kv(tokens, 4, kv_heads, head_dim, dtype)
    assert not k.is_contiguous() and not v.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:tokens]
    slots[[0, 5, 19]] = -1
    ours, ref = cache.clone(), cache.clone()
    store_kvcache(k, v, ours[0, 1], ours[1, 1], slots)
    store_kvcache_torch(k, v, ref[0, 1], ref[1, 1], slots)
    assert torch.equal(ours, ref)  # bit for bit, and nothing outside the slots (layer 0 included) changed
    assert torch.equal(ours[:, 0], cache[:, 0])


@needs_triton
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kernel_slot_dtypes_and_padded_heads(slot_dtype):
    torch.manual_seed(1)
    cache = random_cache(4, 16, 3, 32, torch.float16, num_layers=1)  # 3 heads: padded to 4 in the kernel
    k, v = fused_kv(10, 6, 3, 32, torch.float16)
    slots = torch.randperm(64, device=DEV)[:10].to(slot_dtype)
    slots[2] = -1
    ours, ref = cache.clone(), cache.clone()
    store_kvcache(k, v, ours[0, 0], ours[1, 0], slots)
    store_kvcache_torch(k, v, ref[0, 0], ref[1, 0], slots)
    assert torch.equal(ours, ref)


@needs_triton
def test_kernel_all_skipped_and_empty_batch():
    cache = random_cache(2, 16, 2, 16, torch.float32, num_layers=1)
    before = cache.clone()
    k, v = fused_kv(3, 2, 2, 16, torch.float32)
    store_kvcache(k, v, cache[0, 0], cache[1, 0], torch.full((3,), -1, device=DEV))
    store_kvcache(k[:0], v[:0], cache[0, 0], cache[1, 0], torch.zeros(0, dtype=torch.long, device=DEV))
    assert torch.equal(cache, before)


@needs_triton
def test_kernel_rejects_non_contiguous_cache():
    cache = torch.zeros(2, 16, 2, 32, device=DEV)[..., :16]  # a strided cache view: the kernel assumes contiguity
    k, v = fused_kv(2, 2, 2, 16, torch.float32)
    with pytest.raises(AssertionError):
        store_kvcache(k, v, cache, cache, torch.tensor([0, 1], device=DEV))


def test_get_store_kvcache_chooses_by_device():
    assert get_store_kvcache("cpu") is store_kvcache_torch
    assert get_store_kvcache(torch.device("cpu")) is store_kvcache_torch
    if HAS_TRITON:
        assert get_store_kvcache("cuda") is store_kvcache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 256])
def test_kernel_on_gpu_qwen3_shapes(dtype, block_size):
    torch.manual_seed(0)
    num_blocks, tokens = 4096 // block_size * 8, 3000
    cache = random_cache(num_blocks, block_size, 8, 128, dtype, device="cuda")
    k, v = fused_kv(tokens, 16, 8, 128, dtype, device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens].to(torch.int32)
    slots[::7] = -1
    ours, ref = cache.clone(), cache.clone()
    store_kvcache(k, v, ours[0, 1], ours[1, 1], slots)
    store_kvcache_torch(k, v, ref[0, 1], ref[1, 1], slots)
    torch.cuda.synchronize()
    assert torch.equal(ours, ref)
    # safe in a CUDA graph: no host synchronisation, so capture and replay with new values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kvcache(k, v, ours[0, 0], ours[1, 0], slots)
    k.normal_()
    graph.replay()
    store_kvcache_torch(k, v, ref[0, 0], ref[1, 0], slots)
    torch.cuda.synchronize()
    assert torch.equal(ours, ref)
