# header
__all__ = ['PENDING_TOKEN', 'append_placeholder', 'num_pending_tokens', 'fill_placeholder', 'stop_at',
           'AsyncScheduler', 'AsyncPrefixCachingBlockManager', 'AsyncStepInputs', 'AsyncRunnerMixin',
           'AsyncModelRunner', 'InflightStep', 'AsyncLLMEngine']

from collections.abc import Iterator
from dataclasses import dataclass, fields
from itertools import islice

import torch
from torch import Tensor

from .llm_engine import LLMEngine
from .model_runner import ModelRunner, StepOutput
from .observer import StepObserver
from .prefix_cache import PrefixCachingBlockManager
from .scheduler import Scheduler
from .sequence import Sequence
from .step_inputs import StepInputs

PENDING_TOKEN = -1  # stands for a sampled token whose id has not reached the CPU yet (never a real id)


def append_placeholder(seq: Sequence) -> int:
    """Hold the place of a token the GPU is still sampling; returns its index. The scheduler can plan the
    next step around it; `fill_placeholder` writes the real id later."""
    seq.append_token(PENDING_TOKEN)
    return seq.num_tokens - 1


def num_pending_tokens(seq: Sequence) -> int:
    """Placeholders at the end of `seq` (they are filled oldest first, so they are always its tail)."""
    n = 0
    while n < seq.num_tokens and seq.token_ids[-1 - n] == PENDING_TOKEN:
        n += 1
    return n


def fill_placeholder(seq: Sequence, index: int, token_id: int) -> None:
    """Replace the placeholder at `index` (the oldest pending one) by the sampled token."""
    seq.token_ids[index] = int(token_id)
    if index == seq.num_tokens - 1:
        seq.last_token = int(token_id)


def stop_at(seq: Sequence, index: int) -> None:
    """End `seq` at the known token `index` (an EOS): the placeholders after it are dropped."""
    del seq.token_ids[index + 1:]
    seq.num_tokens = index + 1
    seq.last_token = seq.token_ids[-1]

# %%
class AsyncScheduler(Scheduler):
    """A scheduler that can plan step n+1 before step n's tokens are known: `postprocess` in two halves,
    `reserve` (at launch: counters, a placeholder per token to come, length finishes) and `commit` (when
    the ids arrive: fill placeholders, EOS stops). Stepping one at a time, `postprocess` still serves."""

    def reserve(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """The part of postprocess that needs no token id, done as soon as the step is launched: advance
        `num_computed_tokens`, give each sequence that gets a token a placeholder for it, finish those that
        reach max_tokens or max_model_len. Returns (sequence, placeholder index) pairs for `commit`."""
        pending = []
        for seq in seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_computed_tokens < seq.num_tokens:  # mid-way through a chunked prefill: no token yet
                continue
            pending.append((seq, append_placeholder(seq)))
            if seq.num_completion_tokens >= seq.sampling_params.max_tokens or seq.num_tokens >= self.max_model_len:
                self._finish(seq, "length")
        return pending

    def commit(self, pending: list[tuple[Sequence, int]], token_ids: list[int]) -> list[Sequence]:
        """Write the sampled ids into their placeholders; an EOS stops its sequence there (`"stop"`, also
        over a `"length"` finish planned for a later token). Returns the sequences this step finished."""
        if len(token_ids) != len(pending):
            raise ValueError(f"commit got {len(token_ids)} tokens for {len(pending)} placeholders")
        finished = []
        for (seq, index), token in zip(pending, token_ids):
            if index >= seq.num_tokens:  # the sequence stopped at an earlier EOS: this token is void
                continue
            fill_placeholder(seq, index, token)
            if token == self.eos and not seq.sampling_params.ignore_eos:
                stop_at(seq, index)
                if seq.is_finished:
                    seq.finish_reason = "stop"
                else:
                    self._finish(seq, "stop")
            if seq.is_finished and index == seq.num_tokens - 1:
                finished.append(seq)
        return finished

    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be planned before the tokens of the one in flight are known: a decode
        of the running sequences that admits no one (no one waits, no prompt is half prefilled) and needs
        no preemption (free blocks cover every new block it takes)."""
        if self.waiting or self.prefilling is not None or not self.running:
            return False
        bm = self.block_manager
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        return sum(bm.num_missing_blocks(seq) for seq in islice(self.running, limit)) <= bm.num_free_blocks


class AsyncPrefixCachingBlockManager(PrefixCachingBlockManager):
    """A placeholder is not content: a block that ends in one is published a step later, once it is known."""

    def publish_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        super().publish_full_blocks(seq, min(num_tokens, seq.num_tokens - num_pending_tokens(seq)))

# %%
@dataclass
class AsyncStepInputs(StepInputs):
    """Decode inputs some of whose tokens are still on the device: row b's token is row `source_rows[b]`
    of the previous step's sampled tokens (-1: the token in `input_ids` is known)."""
    source_rows: Tensor | None = None  # int64 [B]


class AsyncRunnerMixin:
    """Runner side of async scheduling: a decode may be launched before the previous step's tokens reach
    the CPU; its pending input tokens are then gathered on the device from that step's sampled tokens."""
    last_sampled: Tensor | None = None  # the previous step's sampled tokens, still on the device
    sampled_rows: dict[int, int] | None = None  # seq_id -> row of last_sampled (rank 0 plans the steps)

    def prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        step = super().prepare_decode(seqs)
        pending = step.input_ids == PENDING_TOKEN
        if not bool(pending.any()):
            return step
        source_rows = torch.full_like(step.input_ids, -1)
        rows = self.sampled_rows or {}
        source_rows[pending] = torch.tensor([rows.get(seq.seq_id, -1)
                                             for seq, wait in zip(seqs, pending.tolist()) if wait])
        if bool((source_rows[pending] < 0).any()):
            raise RuntimeError("a pending token was not sampled by the previous step (async scheduling "
                               "plans one step ahead at most)")
        return AsyncStepInputs(**{f.name: getattr(step, f.name) for f in fields(step)}, source_rows=source_rows)

    def device_inputs(self, step: StepInputs) -> StepInputs:
        step = super().device_inputs(step)
        source = getattr(step, "source_rows", None)
        if source is not None:  # pending tokens: read them where the previous step left them
            step.input_ids = torch.where(source >= 0, self.last_sampled[source.clamp(min=0)], step.input_ids)
        return step

    def execute(self, step: StepInputs, sampling: dict | None = None) -> Tensor | None:
        tokens = super().execute(step, sampling)
        self.last_sampled = tokens
        return tokens

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> StepOutput:
        output = super().launch(seqs, is_prefill)
        self.sampled_rows = {seq.seq_id: row for row, seq in enumerate(output.seqs)}
        return output


class AsyncModelRunner(AsyncRunnerMixin, ModelRunner):
    """The model runner with async inputs."""

# %%
@dataclass
class InflightStep:
    """A launched step: its tokens on their way (`output`), the placeholders they fill (`pending`)."""
    output: StepOutput
    pending: list[tuple[Sequence, int]]  # (sequence, index of its placeholder token)
    num_tokens: int  # tokens processed: positive for prefill, negative for decode


class AsyncLLMEngine(LLMEngine):
    """The engine with async scheduling (`async_scheduling=True`, the default): while the GPU runs step n,
    the CPU plans and launches step n+1 whenever it does not depend on step n's tokens."""
    runner_class = AsyncModelRunner
    scheduler_class = AsyncScheduler

    def make_block_manager(self, num_blocks: int):
        if not self.config.enable_prefix_caching:
            return super().make_block_manager(num_blocks)
        return AsyncPrefixCachingBlockManager(num_blocks, self.config.kvcache_block_size)

    def launch(self) -> InflightStep:
        """Schedule a batch and start it on the device; the bookkeeping that needs no token id is done at
        once (`reserve`), so the next batch can be planned before this one's tokens are known."""
        seqs, is_prefill = self.scheduler.schedule()
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        output = self.model_runner.launch(seqs, is_prefill)
        return InflightStep(output, self.scheduler.reserve(seqs), num_tokens)

    def complete(self, step: InflightStep) -> tuple[list[Sequence], int]:
        """Wait for a launched step's tokens and commit them; returns the sequences it finished."""
        finished = self.scheduler.commit(step.pending, self.model_runner.token_ids(step.output))
        return finished, step.num_tokens

    def steps(self) -> Iterator[tuple[list[Sequence], int]]:
        """Like `LLMEngine.steps`, but launch the next step while the device still runs the one in flight
        whenever the scheduler can plan it now; then wait for the older step's tokens. One step at a time
        when async scheduling is off or an observer watches the steps."""
        if not self.config.async_scheduling or type(self.observer) is not StepObserver:
            yield from super().steps()
            return
        inflight = None
        while inflight is not None or not self.is_finished():
            if inflight is None:
                inflight = self.launch()
                continue
            ahead = self.launch() if self.scheduler.can_schedule_ahead() else None
            finished_step = self.complete(inflight)
            inflight = ahead
            yield finished_step
