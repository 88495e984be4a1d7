# header
__all__ = ['StepInputs']

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor


@dataclass
class StepInputs:
    """Everything one engine step tells the model about its batch. The model runner builds it on the CPU
    (notebook 08), tensor-parallel workers receive it as it is (notebook 12), and it travels down the
    forward call to every attention layer: nothing about a step lives in a global."""
    is_prefill: bool
    input_ids: Tensor     # int64 [T]: the tokens this step computes, every sequence's chunk back to back
    positions: Tensor     # int64 [T]: each token's position in its own sequence
    slot_mapping: Tensor  # int64 [T]: KV-cache slot (block * block_size + offset) of each token, -1: skip
    block_tables: Tensor | None = None  # int32 [B, max_blocks], -1 padded; prefill: only if a context is cached
    cu_seqlens_q: Tensor | None = None  # int32 [B + 1] (prefill): where each sequence's new tokens start
    cu_seqlens_k: Tensor | None = None  # int32 [B + 1] (prefill): the same over whole contexts (cached + new)
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    context_lens: Tensor | None = None  # int32 [B] (decode): tokens in the cache, the new one included
    logits_indices: Tensor | None = None  # int64: rows of the hidden states that get logits (None: all)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.numel() if self.context_lens is not None else self.cu_seqlens_q.numel() - 1

    @property
    def num_sampled(self) -> int:
        """Rows that get logits (and a sampled token)."""
        return self.logits_indices.numel() if self.logits_indices is not None else self.input_ids.numel()

    def to(self, device: torch.device | str) -> "StepInputs":
        """The same inputs on `device`. To a GPU every tensor travels in ONE pinned copy (a launch of
        its own costs more than the bytes): packed as int64, then viewed and cast back."""
        device = torch.device(device)
        tensors = {f.name: value for f in fields(self) if isinstance(value := getattr(self, f.name), Tensor)}
        if device.type != "cuda":
            return replace(self, **{name: t.to(device) for name, t in tensors.items()})
        packed = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors.values()]).pin_memory()
        packed = packed.to(device, non_blocking=True)
        out, offset = {}, 0
        for name, t in tensors.items():
            out[name] = packed[offset: offset + t.numel()].view(t.shape).to(t.dtype)
            offset += t.numel()
        return replace(self, **out)
