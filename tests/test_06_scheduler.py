"""Notebook 06: the scheduler with a fake model (random tokens): budgets, chunked prefill order, preemption
to the front of the queue with recompute, finishing rules, unfittable requests and no infinite loops."""
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm_edu.engine.block_manager import make_block_manager
from nanovllm_edu.engine.scheduler import Scheduler
from nanovllm_edu.engine.sequence import Sequence, SequenceStatus
from nanovllm_edu.sampling_params import SamplingParams

from scheduler_helpers import add_random_requests

EOS = 0


def make(num_blocks=32, block_size=16, caching=False, **cfg):
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024, "eos": (EOS,),
              "mixed_steps": False, "long_prefill_token_threshold": 0} | cfg
    return Scheduler(SimpleNamespace(**fields), make_block_manager(num_blocks, block_size, caching))


def seq(n, max_tokens=8, block_size=16, start=1, **params):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **params), block_size)


def completing(seqs):
    return [s for s in seqs if s.num_computed_tokens + s.num_scheduled_tokens >= s.num_tokens]


def step(sched, token=5):
    seqs, is_prefill = sched.schedule()
    sched.postprocess(seqs, [token] * len(completing(seqs)))
    return seqs, is_prefill


def run(sched, rng=None, on_step=None, max_steps=100_000):
    """Drive to completion with random non-EOS tokens; fail on a runaway loop."""
    rng = rng or random.Random(0)
    for _ in range(max_steps):
        if sched.is_finished():
            return
        seqs, is_prefill = sched.schedule()
        if on_step:
            on_step(seqs, is_prefill)
        sched.postprocess(seqs, [rng.randrange(1, 500) for _ in completing(seqs)])
    raise AssertionError("scheduler did not finish")


def check_step(sched, seqs, is_prefill):
    assert seqs, "schedule returned an empty step while work remains"
    assert len(seqs) <= sched.max_num_seqs
    assert sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens
    assert len({id(s) for s in seqs}) == len(seqs)
    assert all(s.status == SequenceStatus.RUNNING and s.block_table for s in seqs)
    mid = [s for s in seqs if s.num_computed_tokens + s.num_scheduled_tokens < s.num_tokens]
    assert len(mid) <= 1, "two sequences mid-prefill"
    if is_prefill:
        assert all(s.num_scheduled_tokens >= 1 for s in seqs)
        assert mid == [] or mid[0] is seqs[-1], "only the last sequence of a step may be cut"
    else:
        assert all(s.num_scheduled_tokens == 1 and s.num_computed_tokens == s.num_tokens - 1 for s in seqs)
        lens = [s.num_tokens for s in seqs]
        assert lens == sorted(lens, reverse=True), "decode rows must come longest context first"
    for s in seqs:  # the blocks cover every token the step computes
        assert len(s.block_table) * s.block_size >= s.num_computed_tokens + s.num_scheduled_tokens


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([8, 16, 48, 200]), st.integers(1, 6), st.booleans(),
       st.sampled_from([16, 32]))
def test_random_workloads_respect_budgets_and_finish(seed, budget, max_seqs, caching, block_size):
    rng = random.Random(seed)
    sched = make(num_blocks=rng.randint(12, 40), block_size=block_size, caching=caching,
                 max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=300)
    seqs = add_random_requests(sched, rng, caching, block_size)
    run(sched, rng, on_step=lambda batch, is_prefill: check_step(sched, batch, is_prefill))
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    for s in seqs:
        assert s.status == SequenceStatus.FINISHED and s.block_table == []
        expected = min(s.sampling_params.max_tokens, max(1, 300 - s.num_prompt_tokens))
        assert s.num_completion_tokens == expected and s.finish_reason == "length"


def test_prefill_batch_limited_by_tokens_and_seqs():
    sched = make(max_num_batched_tokens=50, max_num_seqs=3)
    seqs = [seq(10) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == seqs[:3]  # seq limit
    sched.postprocess(batch, [5] * 3)
    batch, is_prefill = sched.schedule()
    assert not is_prefill and batch == seqs[:3]  # running is full: decode
    sched = make(max_num_batched_tokens=25, max_num_seqs=8)
    for s in [seq(10) for _ in range(3)]:
        sched.add(s)
    batch, _ = sched.schedule()
    assert [s.num_scheduled_tokens for s in batch] == [10, 10, 5]  # the third is chunked to fit


def test_chunked_prefill_order():
    sched = make(max_num_batched_tokens=32)
    long, short, third = seq(100), seq(10), seq(30)
    for s in (long, short, third):
        sched.add(s)
    plan = []
    for _ in range(6):
        batch, is_prefill = sched.schedule()
        plan.append((is_prefill, [(s is long, s is short, s.num_scheduled_tokens) for s in batch]))
        sched.postprocess(batch, [5] * len(completing(batch)))
    # chunks of 32; the last chunk (4 tokens) shares its step with the next prompts, in arrival order
    assert [p[0] for p in plan[:4]] == [True] * 4
    assert [[c[2] for c in p[1]] for p in plan[:4]] == [[32], [32], [32], [4, 10, 18]]
    assert plan[3][1][0][:2] == (True, False) and plan[3][1][1][:2] == (False, True)
    assert plan[4] == (True, [(False, False, 12)])  # the cut prompt continues before any decode
    assert plan[5][0] is False
    assert long.num_completion_tokens == 2 and long.num_computed_tokens == 101


def test_mid_prefill_sequence_gets_no_token():
    sched = make(max_num_batched_tokens=16)
    s = seq(40)
    sched.add(s)
    batch, _ = sched.schedule()
    assert sched.prefilling is s and s.num_scheduled_tokens == 16
    sched.postprocess(batch, [])  # no sampled token for a cut prompt
    assert s.num_computed_tokens == 16 and s.num_tokens == 40
    batch, _ = sched.schedule()
    sched.postprocess(batch, [9])  # a full-length list: the entry of a mid-prefill sequence is ignored
    assert s.num_tokens == 40 and s.num_computed_tokens == 32
    batch, _ = sched.schedule()
    with pytest.raises(ValueError, match="tokens"):
        sched.postprocess(batch, [1, 2])
    sched.postprocess(batch, [9])
    assert s.token_ids[-1] == 9 and s.num_computed_tokens == 40 and sched.prefilling is None


def test_preemption_requeues_at_front_and_recomputes():
    sched = make(num_blocks=4, max_num_batched_tokens=128)
    old, new, late = seq(32, max_tokens=12), seq(30, max_tokens=12), seq(4, max_tokens=2)
    for s in (old, new, late):
        sched.add(s)
    batch, is_prefill = step(sched)
    assert is_prefill and batch == [old, new]  # late does not fit
    batch, is_prefill = sched.schedule()  # old needs a 3rd block: new (the newest) is preempted
    assert not is_prefill and batch == [old]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert list(sched.waiting) == [new, late] and new.num_preemptions == 1 and sched.num_preemptions == 1
    assert new.num_tokens == 31  # keeps the token it had generated
    sched.postprocess(batch, [5])
    recompute = None
    while new.num_completion_tokens < 12:
        batch, is_prefill = sched.schedule()
        if new in batch and is_prefill:
            recompute = new.num_scheduled_tokens
        sched.postprocess(batch, [5] * len(completing(batch)))
    assert recompute == 31  # prompt + the generated token
    assert old.is_finished and new.is_finished
    run(sched)
    assert sched.block_manager.num_free_blocks == 4


def test_preempts_itself_when_alone_and_out_of_blocks():
    sched = make(num_blocks=4)
    s = seq(48, max_tokens=4)  # 3 full blocks; its first generated token needs a 4th
    sched.add(s)
    step(sched)
    squatter = seq(16)
    sched.block_manager.allocate(squatter)  # blocks held behind the scheduler's back
    with pytest.raises(RuntimeError, match="cannot make progress"):
        sched.schedule()
    assert s.status == SequenceStatus.WAITING and sched.waiting[0] is s and s.num_preemptions == 1
    sched.block_manager.deallocate(squatter)
    run(sched)  # recovers once the blocks are back
    assert s.num_completion_tokens == 4


def test_finish_reasons():
    sched = make()
    a, b, c = seq(5, max_tokens=10), seq(5, max_tokens=3, ignore_eos=True), seq(5, max_tokens=3)
    for s in (a, b, c):
        sched.add(s)
    batch, _ = sched.schedule()
    sched.postprocess(batch, [EOS, EOS, 7])
    assert a.is_finished and a.finish_reason == "stop" and a.completion_token_ids == [EOS] and a.block_table == []
    assert not b.is_finished and not c.is_finished
    run(sched)
    assert b.finish_reason == "length" and b.num_completion_tokens == 3 and c.finish_reason == "length"
    assert sched.running == type(sched.running)() and sched.is_finished()


def test_max_model_len_finishes_with_length():
    sched = make(max_model_len=20)
    s = seq(18, max_tokens=100)
    sched.add(s)
    run(sched)
    assert s.num_tokens == 20 and s.finish_reason == "length"
    full = seq(20, max_tokens=5)  # a prompt of exactly max_model_len still yields one token
    sched.add(full)
    run(sched)
    assert full.num_completion_tokens == 1


def test_unfittable_requests_rejected():
    sched = make(num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"needs up to 7 KV-cache blocks .* has 4.*num_kvcache_blocks"):
        sched.add(seq(59, max_tokens=40))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.check_can_fit(seq(101))
    with pytest.raises(ValueError, match="block size"):
        sched.check_can_fit(seq(5, block_size=32))
    assert sched.is_finished()
    sched.check_can_fit(seq(60, max_tokens=5))  # the last token is never stored: 64 tokens, exactly 4 blocks
    capped = make(num_blocks=4, max_model_len=65)
    capped.check_can_fit(seq(30, max_tokens=1000))  # max_model_len caps it at 64 stored tokens


def test_no_work_and_stuck_cache():
    sched = make(num_blocks=4)
    assert tuple(sched.schedule()) == ([], False)
    sched.block_manager.allocate(seq(40))
    sched.add(seq(40, max_tokens=1))
    with pytest.raises(RuntimeError, match="1 of 4 blocks are free"):
        sched.schedule()


def test_decode_limited_by_token_budget():
    sched = make(max_num_batched_tokens=4, max_num_seqs=8)
    seqs = [seq(2) for _ in range(6)]
    for s in seqs:
        sched.add(s)
    run(sched, on_step=lambda batch, is_prefill: check_step(sched, batch, is_prefill))
    assert all(s.num_completion_tokens == 8 for s in seqs)


def test_decode_rows_longest_first_running_order_kept():
    """A decode step lists its rows longest context first (notebook 12's kernel was seen to start them in that order);
    `running` keeps arrival order, so preemption still picks the newest; equal lengths keep that order."""
    sched = make(max_num_batched_tokens=256)
    short, long, mid, twin = seq(10), seq(60, start=100), seq(30, start=200), seq(30, start=300)
    for s in (short, long, mid, twin):
        sched.add(s)
    step(sched)  # the prefill
    decode, is_prefill = step(sched)
    assert not is_prefill and decode == [long, mid, twin, short]
    assert list(sched.running) == [short, long, mid, twin]


def test_with_real_config():
    config_mod = pytest.importorskip("nanovllm_edu.config")
    from nanovllm_edu.assets import tiny_model_path
    try:
        config = config_mod.Config(tiny_model_path(), max_num_batched_tokens=64, max_num_seqs=4,
                                   kvcache_block_size=16, num_kvcache_blocks=16)
    except (FileNotFoundError, OSError, ValueError) as err:
        pytest.skip(f"tiny model not available: {err}")
    sched = Scheduler(config, make_block_manager(config.num_kvcache_blocks, config.kvcache_block_size, True))
    seqs = [seq(30, max_tokens=10) for _ in range(6)]
    for s in seqs:
        sched.add(s)
    run(sched, on_step=lambda batch, is_prefill: check_step(sched, batch, is_prefill))
    assert all(s.is_finished for s in seqs)


def test_abort_all_frees_everything():
    sched = make(num_blocks=8, max_num_batched_tokens=16)
    seqs = [seq(40), seq(20), seq(10)]
    for s in seqs:
        sched.add(s)
    step(sched)  # the first prompt is mid-prefill
    assert sched.prefilling is seqs[0]
    sched.abort_all()
    assert sched.is_finished() and sched.prefilling is None
    assert sched.block_manager.num_free_blocks == 8
    assert all(s.is_finished and s.finish_reason == "abort" and s.block_table == [] for s in seqs)
    fresh = seq(10, max_tokens=2)
    sched.add(fresh)
    run(sched)
    assert fresh.num_completion_tokens == 2


def test_postprocess_is_reserve_then_commit():
    """One set of finish rules: postprocess's two halves, by hand, finish the same way (notebook 13 calls
    them a step apart)."""
    whole, halves = make(), make()
    for sched in (whole, halves):
        for s in (seq(5, max_tokens=1), seq(5, max_tokens=9, start=9), seq(5, max_tokens=9, start=20)):
            sched.add(s)
    batch, _ = whole.schedule()
    finished = whole.postprocess(batch, [7, EOS, 8])
    batch, _ = halves.schedule()
    pending = halves.reserve(batch)
    assert [s.token_ids[i] for s, i in pending] == [-1, -1, -1]  # placeholders until the ids arrive
    assert batch[0].is_finished and batch[0].finish_reason == "length"  # known without the token's value
    assert halves.commit(pending, [7, EOS, 8]) == [batch[0], batch[1]]
    assert [(s.token_ids, s.finish_reason) for s in finished] == [(s.token_ids, s.finish_reason) for s in batch[:2]]
    assert [s.finish_reason for s in batch] == ["length", "stop", None]


def test_stop_drops_placeholders_after_the_stop_and_refuses_a_known_later_token():
    sched = make()
    s = seq(5, max_tokens=9)
    sched.add(s)
    first = sched.reserve(sched.schedule()[0])
    second = sched.reserve(sched.schedule()[0])  # planned ahead: two placeholders
    sched.commit(first, [7])
    sched.stop(s, first[0][1])  # a stop string ended at token 7: the planned token is dropped
    assert s.completion_token_ids == [7] and s.finish_reason == "stop" and s.block_table == []
    assert sched.commit(second, [8]) == []  # void
    t = seq(5, max_tokens=9, start=30)
    sched.add(t)
    step(sched)
    step(sched)
    with pytest.raises(ValueError, match="not the newest known token"):
        sched.stop(t, t.num_tokens - 2)


@pytest.mark.parametrize("has_blocks", [True, False])
def test_start_running_admits_a_fork_or_preempts_it(has_blocks):
    sched = make()
    child = seq(5, max_tokens=4)
    sched.block_manager.allocate(child)
    sched.start_running(child, 7, has_blocks)
    assert child.completion_token_ids == [7]
    if has_blocks:
        assert list(sched.running) == [child] and child.status == SequenceStatus.RUNNING
    else:
        assert list(sched.waiting) == [child] and child.num_preemptions == 1 and child.block_table == []
