"""The KV-store lab's second exercise (notebook 04): the Triton store kernel is graded by the same checker as the
torch store, and the checker names the failed check for realistic broken kernels (Triton's interpreter on a CPU)."""
import pytest
from lab_helpers import failed_names

from nanovllm_edu.kernels.store_kvcache import HAS_TRITON, store_kvcache
from nanovllm_edu.labs import check_store_kvcache

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs on a CPU)")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one_head_stride(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                               key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                               NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
        """Bug: a slot is HEAD_DIM elements apart in the cache, as if there were one KV head."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        mask = h < NUM_KV_HEADS
        k = tl.load(key_ptr + token * key_stride_t + h * key_stride_h + d, mask=mask)
        v = tl.load(value_ptr + token * value_stride_t + h * value_stride_h + d, mask=mask)
        dst = slot * HEAD_DIM + h * HEAD_DIM + d
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def _store_assuming_contiguous_rows(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                                        key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
        """Bug: reads key/value as if they were contiguous [T, heads, dim] tensors (ignores their strides)."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        mask = h < NUM_KV_HEADS
        row = token * NUM_KV_HEADS * HEAD_DIM + h * HEAD_DIM + d
        k = tl.load(key_ptr + row, mask=mask)
        v = tl.load(value_ptr + row, mask=mask)
        dst = slot * NUM_KV_HEADS * HEAD_DIM + h * HEAD_DIM + d
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def launcher(kernel):
    """`store_kvcache`'s launch around a broken kernel (head_dim a power of two, as the checks use)."""
    def store(key, value, k_cache, v_cache, slot_mapping):
        if key.shape[0] == 0:
            return
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
                                value.stride(0), value.stride(1), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                                BLOCK_H=triton.next_power_of_2(num_kv_heads))
    return store


def test_the_lessons_triton_kernel_passes():
    report = check_store_kvcache(store_kvcache)
    assert report.passed is True, str(report)


def test_a_slot_stride_without_the_heads_is_caught():
    report = check_store_kvcache(launcher(_store_one_head_stride))
    assert "each token lands in its slot" in failed_names(report)
    assert "an empty batch is a no-op" not in failed_names(report)
    assert "hint: slot = block_id * block_size + offset" in str(report)


def test_ignoring_key_strides_is_caught():
    report = check_store_kvcache(launcher(_store_assuming_contiguous_rows))
    assert failed_names(report) == {"strided key/value are read correctly"}, str(report)
    assert "hint: key and value are slices of the qkv projection" in str(report)
