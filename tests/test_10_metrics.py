"""Per-request metrics in every result (lesson 10): the marks of a request's life on one monotonic clock, in
order, under sync and async scheduling, with preemptions counted and n > 1 completions combined."""
import time
from collections import Counter

import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.llm_engine import RequestMetrics

MARKS = ["arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time"]
PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the", "Create a new"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def async_scheduling(request):
    return request.param


def assert_ordered(metrics: dict, start: float, end: float) -> None:
    times = [metrics[name] for name in MARKS]
    assert all(isinstance(t, float) for t in times), metrics
    assert start <= times[0] and times == sorted(times) and times[-1] <= end, metrics


def test_marks_are_in_order_and_inside_the_call(async_scheduling):
    llm = LLM(tiny_model_path(), async_scheduling=async_scheduling, max_num_seqs=2, num_kvcache_blocks=64,
              kvcache_block_size=16)
    start = time.monotonic()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    end = time.monotonic()
    for out in outs:
        assert_ordered(out["metrics"], start, end)
        assert out["metrics"]["num_preemptions"] == 0
    # max_num_seqs=2: the last two requests wait for the first two, so they are scheduled later
    assert outs[3]["metrics"]["first_scheduled_time"] > outs[0]["metrics"]["first_token_time"]
    one = llm.generate(["Return the"], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert one[0]["metrics"]["first_token_time"] == one[0]["metrics"]["last_token_time"]  # a single token


def test_preemptions_are_counted_and_every_token_is_stamped_once(async_scheduling, monkeypatch):
    # 6 blocks of 16 tokens for 3 requests that each grow past 2 blocks: some must be preempted, and their
    # recompute must not stamp the tokens they already had (RequestMetrics.token has no guard against it)
    stamps = Counter()
    original = RequestMetrics.token
    monkeypatch.setattr(RequestMetrics, "token", lambda self, now: (stamps.update([id(self)]), original(self, now)))
    llm = LLM(tiny_model_path(), async_scheduling=async_scheduling, max_num_seqs=4, num_kvcache_blocks=6,
              kvcache_block_size=16)
    start = time.monotonic()
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=28, ignore_eos=True), use_tqdm=False)
    end = time.monotonic()
    assert sorted(stamps.values()) == [28, 28, 28]
    assert sum(out["metrics"]["num_preemptions"] for out in outs) >= 1
    assert sum(out["metrics"]["num_preemptions"] for out in outs) == llm.scheduler.num_preemptions
    for out in outs:
        assert_ordered(out["metrics"], start, end)


def test_n_completions_combine_their_marks(async_scheduling):
    llm = LLM(tiny_model_path(), async_scheduling=async_scheduling, num_kvcache_blocks=64, kvcache_block_size=16)
    out = llm.generate(["Return the"], SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert_ordered(out["metrics"], 0.0, time.monotonic())
    assert len(out["outputs"]) == 3


def test_abort_all_stamps_the_finish():
    llm = LLM(tiny_model_path(), num_kvcache_blocks=64, kvcache_block_size=16)
    seq_id = llm.add_request("Return the", SamplingParams(max_tokens=50))
    llm.step()
    seq = next(s for s in llm.scheduler.running if s.seq_id == seq_id)
    llm.abort_all()
    assert seq.finish_reason == "abort" and seq.metrics.finished_time >= seq.metrics.first_scheduled_time


def test_a_stop_one_token_before_the_length_limit_is_a_finish(async_scheduling):
    """Async scheduling: the step launched ahead has already ended the sequence by length when step n's token
    turns out to be a stop id; the stop still counts as this step's finish (stamped, penalty row freed)."""
    llm = LLM(tiny_model_path(), async_scheduling=async_scheduling, num_kvcache_blocks=64, kvcache_block_size=16)
    ids = llm.generate("Return the", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    k, stop_id = next((i, t) for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    for penalty in (1.0, 1.2):
        params = SamplingParams(temperature=0, max_tokens=k + 2, ignore_eos=True, stop_token_ids=[stop_id],
                                repetition_penalty=penalty)
        out = llm.generate("Return the", params, use_tqdm=False)[0]
        assert out["finish_reason"] == "stop" and out["token_ids"][-1] == stop_id
        assert out["metrics"]["finished_time"] is not None
        assert not llm.model_runner.token_counts.row_of  # the penalty row went back


def test_a_fork_without_a_free_block_can_stop_at_its_first_token(async_scheduling):
    """n > 1 with no block free for a fork's copy of the prompt's last block: the fork waits (preempted); if its
    first token is a stop id it ends there, from the waiting queue."""
    llm = LLM(tiny_model_path(), async_scheduling=async_scheduling, num_kvcache_blocks=2, kvcache_block_size=16)
    prompt = list(range(100, 120))  # one full block and a partly filled one
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]["token_ids"][0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, n=2, stop_token_ids=[first]),
                       use_tqdm=False)[0]
    assert [o["finish_reason"] for o in out["outputs"]] == ["stop", "stop"]
    assert [o["token_ids"] for o in out["outputs"]] == [[first], [first]]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks and llm.is_finished()
