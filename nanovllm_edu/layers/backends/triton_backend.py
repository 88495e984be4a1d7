# header
__all__ = ['TritonBackend']

from torch import Tensor

from ...engine.step_inputs import StepInputs
from ...kernels.paged_attention import paged_decode, varlen_prefill
from ...kernels.store_kvcache import store_kvcache
from .base import AttentionBackend


class TritonBackend(AttentionBackend):
    """Paged attention with this package's Triton kernels (CUDA; on CPU through Triton's interpreter)."""
    name = "triton"
    supports_cuda_graphs = True  # decode reads only tensors and static shapes: no host sync, capturable

    def store_kvcache(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs,
                scale: float) -> Tensor:
        use_cache = step.block_tables is not None and k_cache.numel() > 0
        cu_k = step.cu_seqlens_k if use_cache and step.cu_seqlens_k is not None else step.cu_seqlens_q
        max_q = step.max_seqlen_q or int((step.cu_seqlens_q[1:] - step.cu_seqlens_q[:-1]).max())
        return varlen_prefill(q, k, v, k_cache, v_cache, step.cu_seqlens_q, cu_k, max_q,
                              step.block_tables if use_cache else None, scale)

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs, scale: float) -> Tensor:
        return paged_decode(q, k_cache, v_cache, step.block_tables, step.context_lens, scale)
