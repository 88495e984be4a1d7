# header
__all__ = ['FLASH_ATTN_BLOCK_MULTIPLE', 'FlashAttnBackend']

from torch import Tensor

from ...engine.step_inputs import StepInputs
from ...kernels.store_kvcache import store_kvcache
from .base import AttentionBackend

FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn's paged KV cache needs page sizes that are multiples of 256


class FlashAttnBackend(AttentionBackend):
    """Paged attention through the flash-attn package (CUDA only, optional)."""
    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self, block_size: int = 256):
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of "
                             f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}; use 256 or attention_backend='triton'")
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # optional dependency
        self._varlen, self._with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def store_kvcache(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs,
                scale: float) -> Tensor:
        paged = step.block_tables is not None
        if paged:  # part of the context is cached: read all of it through the block table
            k, v = k_cache, v_cache
        return self._varlen(q, k, v, cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_k=step.cu_seqlens_k,
                            max_seqlen_q=step.max_seqlen_q, max_seqlen_k=step.max_seqlen_k, softmax_scale=scale,
                            causal=True, block_table=step.block_tables if paged else None)

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs, scale: float) -> Tensor:
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=step.context_lens,
                                 block_table=step.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
