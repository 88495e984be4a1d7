"""Paged-attention test helpers (tests 04): random sequences in a shuffled paged cache and the textbook
causal attention they must match."""
import torch

from nanovllm_edu.utils.step_inputs import StepInputs


def reference_attention(q, k, v, scale):
    """Plain causal attention of one sequence whose queries are its last q.shape[0] tokens."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


class PagedSetup:
    """Random sequences stored in a cache whose blocks are shuffled, with -1 padded block tables."""

    def __init__(self, lengths, block_size, num_heads, kv_heads, head_dim=16, seed=0, device="cpu", dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.lengths, self.block_size = lengths, block_size
        self.scale = head_dim ** -0.5
        need = [(n + block_size - 1) // block_size for n in lengths]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[perm.pop() for _ in range(b)] for b in need]
        width = max(need) + 1  # one more column of -1 padding than needed
        self.block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen) for n in lengths]
        self.k = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
        self.v = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
        self.k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)  # garbage around
        self.v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
        self.expected = [reference_attention(q, k, v, self.scale) for q, k, v in zip(self.q, self.k, self.v)]
        if device != "cpu" or dtype != torch.float32:
            move = lambda x: x.to(device=device, dtype=dtype)
            self.q, self.k, self.v = ([move(x) for x in xs] for xs in (self.q, self.k, self.v))
            self.k_cache, self.v_cache = move(self.k_cache), move(self.v_cache)
            self.block_tables = self.block_tables.to(device)
            self.expected = [e.to(device) for e in self.expected]

    def slots(self, i, start, end):
        bs = self.block_size
        return [self.tables[i][p // bs] * bs + p % bs for p in range(start, end)]

    def store_all(self, backend):
        slots = torch.tensor([x for i, n in enumerate(self.lengths) for x in self.slots(i, 0, n)], device=self.k_cache.device)
        backend.store_kvcache(torch.cat(self.k), torch.cat(self.v), self.k_cache, self.v_cache, slots)


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def attn_step(is_prefill=False, **fields):
    """Step inputs carrying only what attention reads (the token fields are empty placeholders)."""
    empty = torch.empty(0, dtype=torch.long)
    slot_mapping = fields.pop("slot_mapping", empty)
    return StepInputs(is_prefill, empty, empty, slot_mapping, **fields)
