# header
__all__ = ['Prompt', 'TOKENIZER_FILES', 'load_tokenizer', 'LLMEngine']

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastcore.basics import patch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..config import Config
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .observer import ObserverGroup, StepObserver
from .prefix_cache import make_block_manager
from .scheduler import Scheduler
from .sequence import Sequence

Prompt = str | list[int]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model: str):
    """The checkpoint's tokenizer, or None for a weights-only folder (prompts must then be token ids)."""
    if not any(Path(model, name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model, local_files_only=True)


class LLMEngine:
    """Continuous-batching engine: requests in, one scheduled batch through the model per `step()`.
    Later notebooks swap in their parts through the class attributes (notebook 10: async scheduling)."""
    runner_class = ModelRunner
    scheduler_class = Scheduler

    def __init__(self, model: str, **engine_args):
        self.config = Config(model, **engine_args)
        self.tokenizer = load_tokenizer(self.config.model)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.config.eos = self.tokenizer.eos_token_id
        self.model_runner = self.runner_class(self.config)
        self.block_manager = self.make_block_manager(self.model_runner.num_kvcache_blocks)
        self.scheduler = self.scheduler_class(self.config, self.block_manager)
        self.observer = StepObserver()  # watches nothing until `observe` attaches one

    def make_block_manager(self, num_blocks: int):
        """The pool of KV blocks the scheduler hands out (with prefix caching unless it is off)."""
        return make_block_manager(num_blocks, self.config.kvcache_block_size, self.config.enable_prefix_caching)

    def exit(self) -> None:
        """Release the engine's worker processes (tensor parallelism, notebook 12); safe to call twice."""
        self.model_runner.exit()

    close = exit

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

# %%
@patch
def _to_token_ids(self: LLMEngine, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("a prompt is empty; every prompt needs at least one token")
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model!r} has no tokenizer files; pass prompts as lists of token ids")
        return self.tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError(f"a prompt must be a string or a list of token ids (ints), got {type(prompt).__name__}")
    vocab = self.config.hf_config.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab}); check the tokenizer used")
    return list(prompt)


@patch
def make_sequence(self: LLMEngine, prompt: Prompt, sampling_params: SamplingParams) -> Sequence:
    """Validate one request completely and build its Sequence (nothing is queued yet)."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
    token_ids = self._to_token_ids(prompt)
    if not token_ids:
        raise ValueError("a prompt is empty; every prompt needs at least one token")
    if len(token_ids) >= self.config.max_model_len:
        raise ValueError(f"a prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                         f"max_model_len={self.config.max_model_len}; shorten it or raise max_model_len")
    seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
    self.scheduler.check_can_fit(seq)
    return seq


@patch
def make_requests(self: LLMEngine, prompts, sampling_params=None) -> list[Sequence]:
    """Validate a batch as `generate` takes it (one prompt or a list; one SamplingParams or one per prompt)
    and build its Sequences; nothing is queued, so a bad request leaves the engine untouched."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt given bare
    prompts = list(prompts)
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    sampling_params = sampling_params or SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    elif len(sampling_params) != len(prompts):
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one "
                         "SamplingParams for all, or exactly one per prompt")
    return [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]


@patch
def add_request(self: LLMEngine, prompt: Prompt, sampling_params: SamplingParams) -> int:
    """Validate and queue one request; returns its sequence id."""
    seq = self.make_sequence(prompt, sampling_params)
    self.scheduler.add(seq)
    return seq.seq_id

# %%
@patch
def step(self: LLMEngine) -> tuple[list[Sequence], int]:
    """One scheduled batch through the model. Returns the sequences that finished and the tokens processed
    (positive for a prefill step, negative for a decode step, as a hint for throughput meters)."""
    observer = self.observer
    observer.step_started(self)
    with observer.part("schedule"):
        seqs, is_prefill = self.scheduler.schedule()
    observer.step_scheduled(self, seqs, is_prefill)
    num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
    token_ids = self.model_runner.run(seqs, is_prefill)
    with observer.part("postprocess"):
        finished = self.scheduler.postprocess(seqs, token_ids)
    observer.step_finished(self, seqs, is_prefill, finished)
    return finished, num_tokens


@patch
def is_finished(self: LLMEngine) -> bool:
    return self.scheduler.is_finished()


@patch
def steps(self: LLMEngine) -> Iterator[tuple[list[Sequence], int]]:
    """Step until every queued request has finished; yields what each `step()` returns."""
    while not self.is_finished():
        yield self.step()


@patch
def abort_all(self: LLMEngine) -> None:
    """Drop every queued and running request and free its blocks (the engine stays usable)."""
    self.scheduler.abort_all()


@patch
@contextmanager
def observe(self: LLMEngine, observer: StepObserver) -> Iterator[StepObserver]:
    """Attach `observer` to this engine and its model runner inside the block, beside any attached already."""
    saved = self.observer
    combined = observer if type(saved) is StepObserver else ObserverGroup([saved, observer])
    self.observer = self.model_runner.observer = combined
    try:
        yield observer
    finally:
        self.observer = self.model_runner.observer = saved

# %%
@patch
def result(self: LLMEngine, seq: Sequence) -> dict:
    """What `generate` returns for a finished sequence; the text leaves out special tokens such as EOS
    (token_ids keep them)."""
    text = (self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
            if self.tokenizer is not None else "")
    return {"text": text, "token_ids": seq.completion_token_ids,
            "finish_reason": seq.finish_reason, "num_cached_tokens": seq.num_cached_tokens}


@patch
def generate(self: LLMEngine, prompts: Prompt | list[Prompt],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[dict]:
    """Generate completions for a batch; results in prompt order with text, token_ids, finish_reason,
    num_cached_tokens. Every request is validated before any runs."""
    seqs = self.make_requests(prompts, sampling_params)
    for seq in seqs:
        self.scheduler.add(seq)
    bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
    rates, last = {"prefill": 0.0, "decode": 0.0}, time.perf_counter()
    try:
        for finished, num_tokens in self.steps():
            now = time.perf_counter()
            rates["prefill" if num_tokens > 0 else "decode"] = abs(num_tokens) / max(now - last, 1e-9)
            last = now
            bar.set_postfix({kind: f"{rate:.0f}tok/s" for kind, rate in rates.items()}, refresh=False)
            bar.update(len(finished))
    except BaseException:
        self.abort_all()  # e.g. Ctrl-C: free every block so the engine serves the next call
        raise
    finally:
        bar.close()
    return [self.result(seq) for seq in seqs]
