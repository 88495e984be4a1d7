# header
__all__ = ['AttentionBackend', 'PagedAttention', 'attach_kv_cache']

from abc import ABC, abstractmethod

import torch
from torch import Tensor, nn

from ...engine.step_inputs import StepInputs
from ..attention import Attention


class AttentionBackend(ABC):
    """What paged attention needs from an attention implementation.

    Shapes: q [T, num_heads, head_dim]; k, v [T, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; outputs [T, num_heads, head_dim].
    """
    name: str = "abstract"
    supports_cuda_graphs: bool = False  # True when decode can be captured in a CUDA graph (notebook 11)

    @abstractmethod
    def store_kvcache(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        """Write the new tokens' keys and values at `slot_mapping` (-1: skip)."""

    @abstractmethod
    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs,
                scale: float) -> Tensor:
        """Causal attention of variable-length sequences (`step.cu_seqlens_q/k`), reading cached context
        through `step.block_tables` when it is set."""

    @abstractmethod
    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs, scale: float) -> Tensor:
        """One query per sequence against `step.context_lens[b]` cached tokens of its block table."""


class PagedAttention(Attention):
    """The model's attention with a KV cache: store the step's new keys and values, then attend through the
    backend. Without step inputs it is the plain attention it replaces."""

    def __init__(self, plain: Attention, k_cache: Tensor, v_cache: Tensor, backend: AttentionBackend):
        super().__init__(plain.num_heads, plain.head_dim, plain.scale, plain.num_kv_heads)
        # views into the engine's cache tensor: plain attributes, not buffers (the engine owns that memory)
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, step: StepInputs | None = None) -> Tensor:
        if step is None:
            return super().forward(q, k, v)
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, step.slot_mapping)
        if step.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, step, self.scale)
        return self.backend.decode(q, self.k_cache, self.v_cache, step, self.scale)


def attach_kv_cache(model: nn.Module, kv_cache: Tensor, backend: AttentionBackend) -> list[PagedAttention]:
    """Swap every `Attention` of `model` (in layer order) for a `PagedAttention` on its slice of `kv_cache`
    [2, layers, blocks, block_size, kv_heads, head_dim]; returns them."""
    slots = [(module, name, child) for module in model.modules() for name, child in module.named_children()
             if isinstance(child, Attention)]
    if len(slots) != kv_cache.shape[1]:
        raise ValueError(f"the model has {len(slots)} attention layers but the cache holds {kv_cache.shape[1]}")
    attached = []
    for layer, (module, name, plain) in enumerate(slots):
        attached.append(PagedAttention(plain, kv_cache[0, layer], kv_cache[1, layer], backend))
        setattr(module, name, attached[-1])
    return attached
