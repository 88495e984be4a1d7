# header
__all__ = ['CPU_KV_BUDGET_BYTES', 'StepOutput', 'ModelRunner']

import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from fastcore.basics import patch
from torch import Tensor

from ..config import Config
from ..layers.backends.base import attach_kv_cache
from ..layers.backends.registry import get_attention_backend
from ..layers.sampler import Sampler
from ..models.qwen3 import Qwen3ForCausalLM, head_dim_of
from ..utils.device import resolve_device
from .observer import StepObserver
from .sequence import Sequence
from .step_inputs import StepInputs

CPU_KV_BUDGET_BYTES = 1 << 30  # CPU cache cap (zero-filling more costs seconds); also at most an eighth of RAM


def _cpu_kv_budget() -> int:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return min(CPU_KV_BUDGET_BYTES, ram // 8)


@dataclass
class StepOutput:
    """The sampled tokens of a launched step: on the device at once, on the CPU after `token_ids` waits."""
    seqs: list[Sequence]  # the sequences that get a token, one per row
    host: Tensor  # the tokens on the CPU: a pinned copy still in flight on a GPU
    ready: "torch.cuda.Event | None" = None  # recorded after that copy (GPU only)

    @classmethod
    def launched(cls, seqs: list[Sequence], tokens: Tensor) -> "StepOutput":
        """Start copying `tokens` to the CPU without waiting for the step to finish."""
        if not tokens.is_cuda:
            return cls(seqs, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, host, ready)

    def token_ids(self, wait=None) -> list[int]:
        """The token ids, once the copy is done; `wait(event)` replaces a plain wait (it may watch workers)."""
        if self.ready is not None:
            wait(self.ready) if wait is not None else self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    """One device's engine room: the model (this rank's shard), the paged KV cache, the sampler. It turns a
    scheduled batch into step inputs, runs the forward pass and samples. Notebooks 10-12 extend it: async
    inputs, CUDA graphs, and tensor parallelism (one runner per rank)."""

    def __init__(self, config: Config, rank: int = 0, device: torch.device | None = None):
        self.config = config
        self.rank, self.tp_size = rank, config.tensor_parallel_size
        self.device = device if device is not None else resolve_device(config.device)
        self.block_size = config.kvcache_block_size
        self.observer = StepObserver()  # the engine hands its observer down (notebook 08: StepObserver)
        self.model = Qwen3ForCausalLM.from_pretrained(config.model, device=self.device, tp_rank=rank,
                                                      tp_size=self.tp_size)
        self.dtype = next(self.model.parameters()).dtype
        self.backend = get_attention_backend(config.attention_backend, self.device, self.block_size)
        self.sampler = Sampler()
        self.num_kvcache_blocks = self.allocate_kv_cache()

    def exit(self) -> None:
        """Release what outlives the runner (nothing here; tensor parallelism stops its workers)."""

# %%
@patch
def block_bytes(self: ModelRunner) -> int:
    """Bytes of K and V for one block across all layers (this rank's KV heads)."""
    cfg = self.config.hf_config
    return 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * head_dim_of(cfg) * self.dtype.itemsize


@patch(as_prop=True)
def num_kv_heads(self: ModelRunner) -> int:
    """KV heads this rank stores: each rank caches the keys and values of its own heads only."""
    return self.config.hf_config.num_key_value_heads // self.tp_size


@patch
def max_useful_blocks(self: ModelRunner) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens could ever hold at once."""
    return self.config.max_num_seqs * math.ceil(self.config.max_model_len / self.block_size)


@patch
@torch.inference_mode()
def warmup(self: ModelRunner) -> None:
    """One forward pass at the full token budget, so its activation peak is measured before sizing the cache."""
    num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len * self.config.max_num_seqs)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
    hidden = self.model(ids, torch.arange(num_tokens, device=self.device) % self.config.max_model_len)
    self.model.compute_logits(hidden[-self.config.max_num_seqs:])


@patch
def gpu_kv_budget(self: ModelRunner) -> int:
    """Bytes left for the cache: total x utilization - (current use + a warm-up's extra peak)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    self.warmup()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
    return int(total * self.config.gpu_memory_utilization - (total - free) - peak_extra)


@patch
def kv_cache_blocks(self: ModelRunner) -> int:
    """How many blocks the cache gets: `num_kvcache_blocks` when set, else what the memory budget holds."""
    if self.config.num_kvcache_blocks > 0:
        return self.config.num_kvcache_blocks
    budget = self.gpu_kv_budget() if self.device.type == "cuda" else _cpu_kv_budget()
    return min(budget // self.block_bytes(), self.max_useful_blocks())


@patch
def allocate_kv_cache(self: ModelRunner) -> int:
    """Create the cache [2, layers, blocks, block_size, kv_heads, head_dim] and give each attention layer its
    views (PagedAttention, notebook 04); returns the number of blocks."""
    cfg = self.config.hf_config
    num_blocks = self.kv_cache_blocks()
    if num_blocks < 1:
        raise ValueError("no memory is left for the KV cache; raise gpu_memory_utilization, lower "
                         "max_num_batched_tokens, or set num_kvcache_blocks")
    self.kv_cache = torch.zeros(2, cfg.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads,
                                head_dim_of(cfg), dtype=self.dtype, device=self.device)
    attach_kv_cache(self.model, self.kv_cache, self.backend)
    return num_blocks

# %%
def block_table_array(seqs: list[Sequence]) -> np.ndarray:
    """Block tables as one [B, max_blocks] int32 array, -1 padded, filled without a per-row Python loop."""
    lens = np.fromiter((len(seq.block_table) for seq in seqs), dtype=np.int64, count=len(seqs))
    table = np.full((len(seqs), int(lens.max())), -1, dtype=np.int32)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
        (b for seq in seqs for b in seq.block_table), dtype=np.int32, count=int(lens.sum()))
    return table


@patch
def prepare_prefill(self: ModelRunner, seqs: list[Sequence]) -> StepInputs:
    """Each sequence's scheduled chunk, back to back: tokens, positions, cache slots, and the cumulative
    lengths that tell attention where each sequence starts; logits only for the prompts that complete."""
    input_ids, positions, slots, logits_indices = [], [], [], []
    cu_q, cu_k = [0], [0]
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        input_ids.extend(seq.token_ids[start:end])
        pos = np.arange(start, end)
        positions.append(pos)
        table = np.asarray(seq.block_table, dtype=np.int64)
        slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
        if end == seq.num_tokens:  # the prompt is complete: its last position predicts the next token
            logits_indices.append(cu_q[-1] - 1)
    cached = any(seq.num_computed_tokens > 0 for seq in seqs)  # some context is read from the cache
    return StepInputs(
        True, torch.tensor(input_ids), torch.from_numpy(np.concatenate(positions)),
        torch.from_numpy(np.concatenate(slots)),
        block_tables=torch.from_numpy(block_table_array(seqs)) if cached else None,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])), max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64))

# %%
@patch
def prepare_decode(self: ModelRunner, seqs: list[Sequence]) -> StepInputs:
    """One token per sequence: its newest token, at position num_tokens - 1, into the slot after its last."""
    n, bs = len(seqs), self.block_size
    table = block_table_array(seqs)
    input_ids = np.fromiter((seq.last_token for seq in seqs), dtype=np.int64, count=n)
    context_lens = np.fromiter((seq.num_tokens for seq in seqs), dtype=np.int64, count=n)  # new token included
    positions = context_lens - 1
    slots = table[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
    return StepInputs(False, torch.from_numpy(input_ids), torch.from_numpy(positions), torch.from_numpy(slots),
                      block_tables=torch.from_numpy(table), max_seqlen_k=int(context_lens.max()),
                      context_lens=torch.from_numpy(context_lens.astype(np.int32)))

# %%
@patch
def prepare_sample(self: ModelRunner, seqs: list[Sequence]) -> dict:
    """Per-row sampling tensors on the device; top-k/top-p and seeds only when some row needs them."""
    params = [seq.sampling_params for seq in seqs]
    vocab = self.config.hf_config.vocab_size

    def tensor(data, dtype):
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    out = {"temperatures": tensor([p.temperature for p in params], torch.float32),
           "all_greedy": all(p.temperature == 0 for p in params)}
    if any(p.top_k != -1 for p in params):
        out["top_ks"] = tensor([p.top_k if p.top_k != -1 else vocab for p in params], torch.int64)
    if any(p.top_p < 1.0 for p in params):
        out["top_ps"] = tensor([p.top_p for p in params], torch.float32)
    seeded = [i for i, p in enumerate(params) if p.seed is not None and p.temperature > 0]
    if seeded:
        out["seeds"] = tensor([p.seed if p.seed is not None else 0 for p in params], torch.int64)
        out["positions"] = tensor([seq.num_tokens for seq in seqs], torch.int64)
        out["seeded_rows"] = tensor(seeded, torch.int64)
    return out

# %%
@patch
def device_inputs(self: ModelRunner, step: StepInputs) -> StepInputs:
    """The step's inputs on this runner's device."""
    return step.to(self.device)


@patch
def forward(self: ModelRunner, step: StepInputs) -> Tensor | None:
    """Hidden states of every token, then logits for the rows that sample (None on a rank without them)."""
    hidden = self.model(step.input_ids, step.positions, step)
    if step.logits_indices is not None:
        hidden = hidden[step.logits_indices]
    return self.model.compute_logits(hidden)


@patch
def sample(self: ModelRunner, logits: Tensor | None, sampling: dict | None, num_rows: int) -> Tensor | None:
    """One token per row of `logits` (a rank without logits samples nothing)."""
    return None if logits is None else self.sampler(logits, **sampling)


@patch
@torch.inference_mode()
def execute(self: ModelRunner, step: StepInputs, sampling: dict | None = None) -> Tensor | None:
    """This rank's part of a step, launched without waiting: inputs to the device, forward, sampling.
    Returns the sampled tokens on the device (None on a rank that does not sample)."""
    with self.observer.part("prepare"):
        step = self.device_inputs(step)
    if step.num_sampled == 0:  # every sequence is mid-way through a chunked prefill: no logits at all
        with self.observer.part("forward"):
            self.model(step.input_ids, step.positions, step)
        return torch.empty(0, dtype=torch.int64, device=self.device) if self.rank == 0 else None
    with self.observer.part("forward"):
        logits = self.forward(step)
    with self.observer.part("sample"):
        return self.sample(logits, sampling, step.num_sampled)

# %%
@patch
def launch(self: ModelRunner, seqs: list[Sequence], is_prefill: bool) -> StepOutput:
    """Start one engine step on the device and return at once; its tokens arrive later (`token_ids`)."""
    with self.observer.part("prepare"):
        step = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        sampled = [seq for seq in seqs if seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens]
        sampling = self.prepare_sample(sampled) if sampled else None
    return StepOutput.launched(sampled, self.execute(step, sampling))


@patch
def wait_event(self: ModelRunner, event: "torch.cuda.Event") -> None:
    """Block until the device has reached `event` (tensor parallelism watches its workers meanwhile)."""
    event.synchronize()


@patch
def token_ids(self: ModelRunner, output: StepOutput) -> list[int]:
    """Wait for a launched step's tokens."""
    with self.observer.part("sample"):
        return output.token_ids(self.wait_event)


@patch
def run(self: ModelRunner, seqs: list[Sequence], is_prefill: bool) -> list[int]:
    """One step, waited for: the token ids of the sequences that sample (prompt complete, or decoding)."""
    return self.token_ids(self.launch(seqs, is_prefill))
