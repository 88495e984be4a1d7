"""Async scheduling (notebook 13): step N+1 is planned and launched before step N's tokens are known.
It must never change what is generated: the scheduler driven one step ahead (with EOS stops, length limits,
preemption, prefix caching) ends exactly where the synchronous scheduler does, and the engine's outputs are
the same with async scheduling on and off."""
import importlib.util
import random
import zlib
from types import SimpleNamespace

import pytest

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.sequence import num_pending_tokens
from nanovllm_edu.course.trace import EngineTrace
from nanovllm_edu.engine.block_manager import BlockManager
from nanovllm_edu.engine.observer import StepObserver
from nanovllm_edu.engine.block_manager import compute_block_hash, make_block_manager
from nanovllm_edu.engine.scheduler import PENDING_TOKEN, Scheduler, append_placeholder, fill_placeholder
from nanovllm_edu.engine.sequence import Sequence

from helpers import generate_counting_ahead, without_metrics

EOS = 0


def make_scheduler(num_blocks, block_size=16, caching=True, sync=False, **cfg):
    """The engine's scheduler and block manager (one class each: async scheduling grows them in place); `sync`
    only names how the test drives them: one step at a time."""
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "eos": (EOS,),
              "mixed_steps": False, "long_prefill_token_threshold": 0} | cfg
    return Scheduler(SimpleNamespace(**fields), make_block_manager(num_blocks, block_size, caching))


def drive_sync(sched: Scheduler) -> None:
    """Notebook 06's loop: schedule, then postprocess with the step's tokens."""
    for _ in range(100_000):
        if sched.is_finished():
            return
        seqs, _ = sched.schedule()
        sampled = [seq for seq in seqs if seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens]
        sched.postprocess(seqs, [fake_token(seq, seq.num_tokens) for seq in sampled])
    raise AssertionError("runaway loop")


def fake_token(seq: Sequence, index: int) -> int:
    """A 'model' whose next token depends only on the prompt and the position: EOS about one time in 12."""
    h = zlib.crc32(repr((seq.prompt_token_ids, index)).encode())
    return EOS if h % 12 == 0 else 1 + h % 40


def drive(sched: Scheduler, ahead: bool) -> int:
    """Run the scheduler to the end like LLMEngine.generate; returns how many steps were planned ahead."""
    inflight, num_ahead = None, 0
    for _ in range(100_000):
        if inflight is None and sched.is_finished():
            return num_ahead
        if inflight is None:
            inflight = sched.reserve(sched.schedule()[0])
            continue
        upcoming = None
        if ahead and sched.can_schedule_ahead():
            upcoming, num_ahead = sched.reserve(sched.schedule()[0]), num_ahead + 1
        sched.commit(inflight, [fake_token(seq, index) for seq, index in inflight])
        inflight = upcoming
    raise AssertionError("runaway loop")


def requests(rng: random.Random, n: int, shared_prefix: list[int]) -> list[Sequence]:
    seqs = []
    for i in range(n):
        own = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))]
        prompt = (shared_prefix if i % 2 else []) + own
        seqs.append(Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=i % 3 == 0), 16))
    return seqs


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12), num_blocks=st.integers(8, 40),
       max_num_seqs=st.sampled_from([1, 3, 8]), caching=st.booleans(), budget=st.sampled_from([16, 64]))
def test_scheduling_ahead_never_changes_the_outcome(seed, n, num_blocks, max_num_seqs, caching, budget):
    outcomes = []
    for mode in ("sync", "lockstep", "ahead"):
        rng = random.Random(seed)
        shared = [rng.randrange(1, 50) for _ in range(20)]
        sched = make_scheduler(num_blocks, caching=caching, sync=mode == "sync", max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget)
        seqs = requests(rng, n, shared)
        for seq in seqs:
            sched.add(seq)  # each fits the smallest cache alone: 8 blocks of 16 > 59 + 59 tokens
        if mode == "sync":
            drive_sync(sched)
        else:
            drive(sched, ahead=mode == "ahead")
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "a block leaked"
        for seq in seqs:
            assert PENDING_TOKEN not in seq.token_ids and num_pending_tokens(seq) == 0
            assert seq.num_completion_tokens <= seq.sampling_params.max_tokens
        for block in bm.blocks:  # every published hash is over real tokens
            assert PENDING_TOKEN not in block.token_ids
        outcomes.append([(s.token_ids, s.finish_reason, s.num_cached_tokens) for s in seqs])
    assert outcomes[0] == outcomes[1] == outcomes[2]


def test_scheduling_ahead_happens_and_eos_overrides_a_planned_length_stop():
    sched = make_scheduler(16)
    seq = Sequence([5, 6, 7], SamplingParams(max_tokens=2), 16)
    sched.add(seq)
    first = sched.reserve(sched.schedule()[0])  # prefill: samples completion token 1
    assert sched.can_schedule_ahead()
    second = sched.reserve(sched.schedule()[0])  # decode planned ahead: its token 2 is the last (max_tokens=2)
    assert seq.is_finished and seq.finish_reason == "length" and num_pending_tokens(seq) == 2
    assert sched.commit(first, [EOS]) == [seq]  # ... but token 1 was EOS: the sequence stops there
    assert seq.finish_reason == "stop" and seq.completion_token_ids == [EOS]
    assert sched.commit(second, [9]) == []  # the planned token is void
    assert seq.completion_token_ids == [EOS] and sched.block_manager.num_free_blocks == 16


def test_a_block_is_published_only_once_its_tokens_are_known():
    bm = make_block_manager(8, 16, True)
    seq = Sequence(list(range(1, 16)), SamplingParams(), 16)  # 15 tokens: one short of a full block
    bm.allocate(seq)
    index = append_placeholder(seq)  # the 16th token is still on the GPU
    bm.may_append(seq)
    assert bm.blocks[seq.block_table[0]].hash == -1
    fill_placeholder(seq, index, 42)
    append_placeholder(seq)
    bm.may_append(seq)  # the next step publishes it, with the real token
    assert bm.blocks[seq.block_table[0]].hash == compute_block_hash(list(range(1, 16)) + [42])


PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the given",
           "Create a new", "If the file does not exist, the function returns None and logs a warning; otherwise"]
SMALL = dict(max_num_seqs=16, num_kvcache_blocks=64, kvcache_block_size=16)


@pytest.mark.parametrize("args", [{}, dict(max_num_batched_tokens=16), dict(num_kvcache_blocks=6)],
                         ids=["plain", "chunked prefill", "preemption"])
def test_engine_output_is_the_same_with_and_without_async_scheduling(args):
    settings_ = SMALL | args
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (5, 40, 17, 64, 30)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7)]  # seeded: reproducible
    prompts = PROMPTS + ["Return a new"]
    sync = LLM(tiny_model_path(), async_scheduling=False, **settings_).generate(prompts, params, use_tqdm=False)
    outs, num_ahead = generate_counting_ahead(LLM(tiny_model_path(), **settings_), prompts, params)
    assert num_ahead > 10, "decode steps should be launched ahead of the previous step's tokens"
    assert without_metrics(outs) == without_metrics(sync)
    assert {o["finish_reason"] for o in outs} == {"stop", "length"}  # EOS stops and length stops both occur


def test_async_scheduling_grows_the_one_scheduler_in_place():
    """Finishing has one owner: async scheduling adds when to plan ahead to notebook 06's scheduler, no subclass
    with another set of rules (and no module of its own)."""
    assert "can_schedule_ahead" in vars(Scheduler)
    assert importlib.util.find_spec("nanovllm_edu.engine.async_scheduling") is None


class EventLog(StepObserver):
    """Writes down when steps start and finish."""

    def __init__(self, one_step_at_a_time=False):
        self.one_step_at_a_time, self.events = one_step_at_a_time, []

    def step_started(self, engine):
        self.events.append("start")

    def step_finished(self, engine, seqs, is_prefill, finished):
        self.events.append("finish")


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_observers_watch_the_async_path_unless_they_ask_for_one_step_at_a_time(one_at_a_time):
    llm = LLM(tiny_model_path(), **SMALL)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (5, 40, 17, 64, 30)]
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    with llm.observe(EventLog(one_at_a_time)) as log:
        watched = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o["token_ids"] for o in watched] == [o["token_ids"] for o in plain]  # (the second run hits the cache)
    in_flight, overlaps = 0, 0  # overlaps: steps that started while another was still in flight
    for event in log.events:
        overlaps += event == "start" and in_flight > 0
        in_flight += 1 if event == "start" else -1
    assert log.events.count("start") == log.events.count("finish") > 10
    assert (overlaps == 0) if one_at_a_time else (overlaps > 10)


def test_the_trace_records_the_async_engine_step_by_step():
    llm = LLM(tiny_model_path(), **SMALL)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (5, 40, 17, 64, 30)]
    with EngineTrace(llm) as trace:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    decode_tokens = sum(r.num_tokens for r in trace.records if r.kind == "decode")
    # every decode row is a token; a row planned past an EOS is void, so rows >= tokens kept
    assert decode_tokens >= sum(len(o["token_ids"]) for o in outs) - len(outs)
    assert [r.step for r in trace.records] == list(range(len(trace.records)))
    assert all(r.seconds >= 0 for r in trace.records)
    finished = [i for r in trace.records for i in r.finished]
    assert sorted(finished) == sorted(set(finished)) and len(finished) == len(outs)
