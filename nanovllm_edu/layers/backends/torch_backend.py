# header
__all__ = ['TorchBackend']

import torch
import torch.nn.functional as F
from torch import Tensor

from ...engine.step_inputs import StepInputs
from ...kernels.store_kvcache import store_kvcache_torch
from .base import AttentionBackend


def _causal_offsets_mask(q_lens: Tensor, ctx_lens: Tensor, max_q: int, max_k: int) -> Tensor:
    """[B, 1, max_q, max_k] bool: query i of sequence b (at position ctx_len - q_len + i) sees keys <= it."""
    qpos = ctx_lens[:, None] - q_lens[:, None] + torch.arange(max_q, device=q_lens.device)  # [B, max_q]
    kpos = torch.arange(max_k, device=q_lens.device)
    return (kpos[None, None, :] <= qpos[:, :, None])[:, None]


def _paged_slots(block_tables: Tensor, ctx_lens: Tensor, max_k: int, block_size: int) -> Tensor:
    """[B * max_k] cache slots of positions 0..max_k-1 of every sequence (0 where past its context)."""
    pos = torch.arange(max_k, device=block_tables.device)
    blocks = block_tables.long()[:, pos // block_size]  # [B, max_k]
    slots = blocks * block_size + pos % block_size
    valid = (pos[None, :] < ctx_lens[:, None]) & (blocks >= 0)
    return torch.where(valid, slots, 0).reshape(-1)  # slot 0 is finite garbage that the mask hides


class TorchBackend(AttentionBackend):
    """Paged attention in plain PyTorch: the CPU engine's attention and the reference for GPU kernels."""
    name = "torch"

    def __init__(self):
        self._plan_key: tuple | None = None
        self._plan: dict | None = None

    def store_kvcache(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping)

    def _cached_plan(self, kind: str, step: StepInputs, block_size: int, build) -> dict:
        # Every layer of one step sees the same context; build index tensors once. We hold references to
        # the keyed objects, so an `is` match can never be a recycled id.
        key = (kind, block_size, step, step.cu_seqlens_q, step.cu_seqlens_k, step.context_lens, step.block_tables)
        if self._plan_key is not None and all(x is y for x, y in zip(key, self._plan_key)):
            return self._plan
        plan = build()
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self._plan_key, self._plan = key, plan
        return plan

    def _varlen_plan(self, step: StepInputs, num_tokens: int, device: torch.device) -> dict:
        """Indices to pad packed tokens into [B, max_q] and back."""
        cu_q = step.cu_seqlens_q.to(device=device, dtype=torch.long)
        q_lens = cu_q[1:] - cu_q[:-1]
        batch = q_lens.numel()
        max_q = step.max_seqlen_q if step.max_seqlen_q > 0 else int(q_lens.max())
        offsets = torch.arange(max_q, device=device)
        pad_idx = (cu_q[:-1, None] + offsets).clamp_max(num_tokens - 1).reshape(-1)  # [B * max_q]
        seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_tokens)
        unpad_idx = seq_of_token * max_q + torch.arange(num_tokens, device=device) - cu_q[seq_of_token]
        return {"batch": batch, "max_q": max_q, "q_lens": q_lens, "pad_idx": pad_idx, "unpad_idx": unpad_idx}

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs,
                scale: float) -> Tensor:
        num_tokens, num_heads, head_dim = q.shape
        use_cache = step.block_tables is not None and k_cache.numel() > 0
        if not use_cache and step.cu_seqlens_q.numel() == 2:  # one sequence, nothing cached: no padding at all
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(0, 1)
        block_size = k_cache.shape[1] if use_cache else 0
        plan = self._cached_plan("prefill", step, block_size,
                                 lambda: self._prefill_plan(step, num_tokens, q.device, block_size))
        batch, max_q = plan["batch"], plan["max_q"]
        qp = q.index_select(0, plan["pad_idx"]).view(batch, max_q, num_heads, head_dim).transpose(1, 2)
        if not use_cache:
            # Right padding: a real query i only sees keys j <= i, all real, so plain causal is exact.
            kp, vp = (x.index_select(0, plan["pad_idx"]).view(batch, max_q, -1, head_dim).transpose(1, 2)
                      for x in (k, v))
            out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp, vp = self._gather(k_cache, v_cache, plan["slots"], batch, plan["max_k"])
            out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=plan["mask"], scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
        return out.index_select(0, plan["unpad_idx"])

    def _prefill_plan(self, step: StepInputs, num_tokens: int, device: torch.device, block_size: int) -> dict:
        plan = self._varlen_plan(step, num_tokens, device)
        if block_size:
            cu_k = step.cu_seqlens_k.to(device=device, dtype=torch.long)
            ctx_lens = cu_k[1:] - cu_k[:-1]
            max_k = step.max_seqlen_k if step.max_seqlen_k > 0 else int(ctx_lens.max())
            plan["max_k"] = max_k
            plan["slots"] = _paged_slots(step.block_tables.to(device), ctx_lens, max_k, block_size)
            plan["mask"] = _causal_offsets_mask(plan["q_lens"], ctx_lens, plan["max_q"], max_k)
        return plan

    @staticmethod
    def _gather(k_cache: Tensor, v_cache: Tensor, slots: Tensor, batch: int, max_k: int) -> tuple[Tensor, Tensor]:
        """Keys and values of every sequence's context, [B, kv_heads, max_k, head_dim] each."""
        kv_heads, head_dim = k_cache.shape[-2:]
        return tuple(c.view(-1, kv_heads * head_dim).index_select(0, slots)
                     .view(batch, max_k, kv_heads, head_dim).transpose(1, 2) for c in (k_cache, v_cache))

    def decode(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepInputs, scale: float) -> Tensor:
        batch, num_heads, head_dim = q.shape
        kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        plan = self._cached_plan("decode", step, block_size, lambda: self._decode_plan(step, q.device, block_size))
        kp, vp = self._gather(k_cache, v_cache, plan["slots"], batch, plan["max_k"])
        # GQA without copies: the query heads of one KV head form the rows of one [group, head_dim] matrix.
        qg = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(qg, kp, vp, attn_mask=plan["mask"], scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    @staticmethod
    def _decode_plan(step: StepInputs, device: torch.device, block_size: int) -> dict:
        ctx_lens = step.context_lens.to(device=device, dtype=torch.long)
        max_k = step.max_seqlen_k if step.max_seqlen_k > 0 else int(ctx_lens.max())
        slots = _paged_slots(step.block_tables.to(device), ctx_lens, max_k, block_size)
        mask = (torch.arange(max_k, device=device)[None, :] < ctx_lens[:, None])[:, None, None, :]
        return {"max_k": max_k, "slots": slots, "mask": mask}
