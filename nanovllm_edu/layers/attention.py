# header
__all__ = ['causal_attention', 'Attention']

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    "Causal attention of one sequence: q [T, H, d], k/v [T, KV, d] with H a multiple of KV -> [T, H, d]."
    group = q.shape[1] // k.shape[1]
    # query head h reads KV head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1).contiguous()


class Attention(nn.Module):
    """Attention over the tokens of ONE sequence, causal, without a KV cache. The engine's step inputs
    (`step`, notebook 04) pass through untouched: the paged attention of notebook 04 subclasses this
    module and reads them."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Any = None) -> torch.Tensor:
        return causal_attention(q, k, v, self.scale)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
