"""Mixed steps (notebook 06): decodes and capped prefill chunks share a step. Greedy output equals transformers
and the separate-steps policy (plain, preemption, prefix caching, async on and off, n > 1, TP=2 on CPU); a
long prompt's chunked prefill stalls the running decodes at most 2 steps; budgets, caps and max_num_seqs hold
on random workloads; the settings are validated; a mixed step's inputs and attention equal two separate steps."""
import random
from functools import cache
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import given, settings
from hypothesis import strategies as st
from parity import hf_greedy
from scheduler_helpers import add_random_requests

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import Config
from nanovllm_edu.course.trace import EngineTrace
from nanovllm_edu.engine.llm_engine import load_tokenizer
from nanovllm_edu.engine.model_runner import ModelRunner
from nanovllm_edu.engine.scheduler import ScheduledBatch, num_decode_rows
from nanovllm_edu.engine.block_manager import make_block_manager
from nanovllm_edu.engine.scheduler import Scheduler
from nanovllm_edu.engine.sequence import Sequence, SequenceStatus
from nanovllm_edu.layers.attention import Attention
from nanovllm_edu.layers.backends.base import PagedAttention
from nanovllm_edu.layers.backends.registry import get_attention_backend
from nanovllm_edu.sampling_params import SamplingParams as Params

TINY = str(tiny_model_path())
# a 48-token budget with 16-token chunks: prompts prefill over several steps beside the running decodes
MIX = dict(max_num_seqs=16, kvcache_block_size=16, max_num_batched_tokens=48, long_prefill_token_threshold=16)
GREEDY = SamplingParams(temperature=0, max_tokens=24)
SHORT = ["Return the", "This module provides a class that", "Raise ValueError if the given", "Create a new",
         "If the file does not exist, the function returns None and logs a warning; otherwise"]
LONG_TEXT = "If the file does not exist, the function returns None and logs a warning; otherwise " * 5  # 91 tokens
SHARED_TEXT = "Return the number of items in the container, counting nested containers recursively. " * 2  # 35


@cache
def encode(text: str) -> tuple[int, ...]:
    return tuple(load_tokenizer(TINY).encode(text))


def workload(name: str) -> list[list[int]]:
    if name == "prefix":  # three prompts share 2 full blocks (35 tokens), interleaved with others
        shared = list(encode(SHARED_TEXT))
        return [shared + list(encode(" First")), list(encode(LONG_TEXT)), shared + list(encode(" Second")),
                list(encode("Create a new")), shared + list(encode(" Third the")), list(encode("Return the"))]
    return [list(encode(p)) for p in SHORT] + [list(encode(LONG_TEXT)), list(encode("This module provides a class that " * 5))]


@cache
def reference(name: str) -> list[list[int]]:
    """transformers' greedy completions of a workload (computed once per module)."""
    return hf_greedy(TINY, workload(name), GREEDY.max_tokens)


def traced_generate(llm, prompts, params):
    with EngineTrace(llm) as trace:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, trace


def num_mixed(trace) -> int:
    """Steps that held decode rows and prefill chunk rows together."""
    return sum(1 for r in trace.records if r.kind == "mixed" and 0 < r.num_decode_rows < r.batch_size)


# ------------------------------------------------------------------------------------------------------------
# 1. greedy parity under mixing
SCENARIOS = {
    "plain": dict(num_kvcache_blocks=64),
    "preemption": dict(num_kvcache_blocks=10),  # 160 cache slots for ~190 prompt tokens + completions
    "prefix": dict(num_kvcache_blocks=64),  # shared-prefix prompts admitted in one generate call
    "prefix-warm": dict(num_kvcache_blocks=64),  # the shared prefix computed by an earlier call
}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mixed_greedy_matches_transformers_and_separate_steps(scenario, async_scheduling):
    data = "prefix" if scenario.startswith("prefix") else "plain"
    prompts, expected = workload(data), reference(data)
    results = {}
    for mixed in (True, False):
        llm = LLM(TINY, mixed_steps=mixed, async_scheduling=async_scheduling, **MIX, **SCENARIOS[scenario])
        if scenario == "prefix-warm":
            llm.generate([list(encode(SHARED_TEXT)) + list(encode(" Zero"))], GREEDY, use_tqdm=False)
        outs, trace = traced_generate(llm, prompts, GREEDY)
        results[mixed] = [o["token_ids"] for o in outs]
        if mixed:
            assert num_mixed(trace) > 0, "no step held decode rows and chunks together"
            assert all(r.chunks[i] <= 16 for r in trace.records for i in range(r.num_decode_rows, r.batch_size))
            if scenario == "preemption":
                assert llm.scheduler.num_preemptions > 0 and trace.summary()["preemptions"] > 0
            if data == "prefix":
                assert sum(o["num_cached_tokens"] for o in outs) > 0 and llm.block_manager.num_hit_blocks > 0
        else:
            assert num_mixed(trace) == 0
    assert results[False] == expected, "separate steps differ from transformers"
    wrong = [i for i, (got, want) in enumerate(zip(results[True], expected)) if got != want]
    assert not wrong, (f"mixed steps differ from transformers on prompts {wrong}: "
                       + "; ".join(f"got {results[True][i]} expected {expected[i]}" for i in wrong))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_mixed_n_greedy_completions_match_separate_steps(async_scheduling):
    prompts = workload("plain")
    params = SamplingParams(temperature=0, max_tokens=24, n=3)
    completions = {}
    for mixed in (True, False):
        llm = LLM(TINY, mixed_steps=mixed, async_scheduling=async_scheduling, num_kvcache_blocks=64, **MIX)
        outs, trace = traced_generate(llm, prompts, params)
        completions[mixed] = [[o["token_ids"] for o in out["outputs"]] for out in outs]
        assert (num_mixed(trace) > 0) == mixed
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert completions[True] == completions[False]
    assert completions[True] == [[ref] * 3 for ref in reference("plain")]


def test_mixed_tp2_on_cpu_matches_transformers():
    """One TP=2 engine (gloo ranks on the CPU, as in test_17_tensor_parallel.py) with mixed steps."""
    prompts = workload("plain")[3:]  # short, long and medium prompts: the long one prefills beside decodes
    expected = hf_greedy(TINY, prompts, 16)
    llm = LLM(TINY, tensor_parallel_size=2, device="cpu", num_kvcache_blocks=64, mixed_steps=True, **MIX)
    try:
        outs, trace = traced_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=16))
    finally:
        llm.exit()
    assert num_mixed(trace) > 0
    assert [o["token_ids"] for o in outs] == expected


# ------------------------------------------------------------------------------------------------------------
# 2. the stall bound: a long prompt's chunked prefill delays the running decodes at most 2 steps
def run_with_late_long_prompt(mixed: bool):
    """Four requests decode; after 3 steps a 200-token prompt arrives. Returns the trace, the long prompt's id,
    the short ids, and how many steps async scheduling planned ahead while the long prompt was prefilling."""
    llm = LLM(TINY, mixed_steps=mixed, num_kvcache_blocks=64, **MIX)
    assert llm.config.async_scheduling  # the default
    long_prompt = [(37 * i) % 4000 + 10 for i in range(200)]
    shorts = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)) for p in SHORT[:4]]
    long_seq, ahead = None, [0]
    original = llm.scheduler.can_schedule_ahead

    def counted():
        ok = original()
        ahead[0] += bool(ok and long_seq is not None and long_seq.num_computed_tokens < 200)
        return ok

    llm.scheduler.can_schedule_ahead = counted
    with EngineTrace(llm) as trace:
        for i, _ in enumerate(llm.steps()):
            if i == 2:
                long_id = llm.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4))
                long_seq = next(s for s in llm.scheduler.waiting if s.seq_id == long_id)
    return trace, long_id, shorts, ahead[0]


def missed_steps(trace, long_id: int, shorts: list[int]) -> dict[int, int]:
    """For each short request decoding when the long prompt's first chunk ran: the steps from that chunk to
    the long prompt's last chunk in which it got no decode row."""
    records = trace.records
    chunk_steps, done = [], 0
    for k, r in enumerate(records):
        if long_id in r.seq_ids and done < 200:
            done += r.chunks[r.seq_ids.index(long_id)]
            chunk_steps.append(k)
    assert done == 200, "the long prompt's chunks do not add up to its 200 tokens"
    first, last = chunk_steps[0], chunk_steps[-1]
    decoding = [s for s in shorts if any(s in r.seq_ids[:r.num_decode_rows] for r in records[:first])]
    assert len(decoding) == 4, "the short requests were not decoding when the long prompt arrived"
    assert not any(s in r.finished for r in records[:last + 1] for s in decoding)
    window = records[first:last + 1]
    return {s: sum(1 for r in window if s not in r.seq_ids[:r.num_decode_rows]) for s in decoding}


def test_long_prefill_stalls_running_decodes_at_most_two_steps():
    trace, long_id, shorts, ahead = run_with_late_long_prompt(mixed=True)
    misses = missed_steps(trace, long_id, shorts)
    assert max(misses.values()) <= 2, f"decodes missed steps during the long prefill: {misses}"
    # the prompt went in 16-token chunks, each beside the decodes, and those steps were planned ahead
    long_chunks = [r.chunks[r.seq_ids.index(long_id)] for r in trace.records
                   if long_id in r.seq_ids[r.num_decode_rows:]]
    assert sum(long_chunks) == 200 and max(long_chunks) <= 16
    assert ahead > 0, "async scheduling planned no step ahead while the long prompt prefilled"


def test_separate_steps_stall_running_decodes_for_the_whole_prefill():
    """The same workload with mixed_steps=False: every decode waits out the long prompt's ceil(200/48) = 5
    prefill steps, so the bound above would catch a regression to separate steps."""
    trace, long_id, shorts, _ = run_with_late_long_prompt(mixed=False)
    misses = missed_steps(trace, long_id, shorts)
    assert min(misses.values()) >= 4, misses


# ------------------------------------------------------------------------------------------------------------
# 3. budgets, caps and max_num_seqs on random workloads (the scheduler with a fake model)
EOS = 0


def make(num_blocks=32, block_size=16, caching=False, **cfg):
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024, "eos": (EOS,),
              "mixed_steps": True, "long_prefill_token_threshold": 0} | cfg
    return Scheduler(SimpleNamespace(**fields), make_block_manager(num_blocks, block_size, caching))


def completing(seqs):
    return [s for s in seqs if s.num_computed_tokens + s.num_scheduled_tokens >= s.num_tokens]


def run(sched, rng, before_step=None, on_step=None, max_steps=100_000):
    """Drive to completion with random non-EOS tokens; fail on a runaway loop."""
    for _ in range(max_steps):
        if sched.is_finished():
            return
        state = before_step() if before_step else None
        seqs, is_prefill = sched.schedule()
        if on_step:
            on_step(state, seqs, is_prefill)
        sched.postprocess(seqs, [rng.randrange(1, 500) for _ in completing(seqs)])
    raise AssertionError("scheduler did not finish")


def check_mixed_step(sched, decoding_before, seqs, is_prefill):
    """`decoding_before`: the running sequences that had all but their newest token computed before schedule()."""
    assert seqs, "schedule returned an empty step while work remains"
    assert len(seqs) <= sched.max_num_seqs
    assert sum(s.num_scheduled_tokens for s in seqs) <= sched.max_num_batched_tokens
    assert len({id(s) for s in seqs}) == len(seqs)
    assert all(s.status == SequenceStatus.RUNNING and s.block_table for s in seqs)
    n = num_decode_rows(seqs)  # the runner's split (notebook 07)
    decodes, chunks = seqs[:n], seqs[n:]
    # the scheduled decodes lead; after them the runner may count a readmitted sequence whose cached prefix
    # covers all but its last token (the same computation)
    scheduled = [s for s in decodes if id(s) in decoding_before]
    assert decodes[:len(scheduled)] == scheduled
    # a sequence with a token being sampled must be a decode row (async scheduling fills only those on the
    # device); a prompt whose one last token remains may lead the chunks
    assert not any(id(s) in decoding_before and s.num_completion_tokens for s in chunks), "a decode row after a chunk"
    assert all(s.num_scheduled_tokens == 1 and s.num_computed_tokens == s.num_tokens - 1 for s in decodes)
    lens = [s.num_tokens for s in scheduled]
    assert lens == sorted(lens, reverse=True), "decode rows must come longest context first"
    # every running decode got its row, up to the limit
    one_token = [s for s in seqs if id(s) in decoding_before]
    left_out = [s for s in sched.running if id(s) in decoding_before and s not in one_token]
    assert not left_out or len(one_token) == min(sched.max_num_seqs, sched.max_num_batched_tokens)
    for s in chunks:
        assert 1 <= s.num_scheduled_tokens <= sched.chunk_cap, "a chunk over the cap"
        assert s.num_computed_tokens + s.num_scheduled_tokens <= s.num_tokens
    assert is_prefill == any(id(s) not in decoding_before for s in seqs)  # the scheduler's chunks: all but decodes
    for s in seqs:  # the blocks cover every token the step computes
        assert len(s.block_table) * s.block_size >= s.num_computed_tokens + s.num_scheduled_tokens


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([8, 16, 48, 200]), st.integers(1, 6), st.booleans(),
       st.sampled_from([16, 32]), st.sampled_from([0, 1, 5, 16, 64]))
def test_random_mixed_workloads_respect_budget_cap_and_seqs_and_finish(seed, budget, max_seqs, caching,
                                                                     block_size, cap):
    rng = random.Random(seed)
    sched = make(num_blocks=rng.randint(12, 40), block_size=block_size, caching=caching,
                 max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=300,
                 long_prefill_token_threshold=cap)
    assert sched.chunk_cap == (cap or budget)
    seqs = add_random_requests(sched, rng, caching, block_size)

    def before():
        return {id(s) for s in sched.running if s.num_tokens - s.num_computed_tokens == 1}

    run(sched, rng, before, lambda state, batch, is_prefill: check_mixed_step(sched, state, batch, is_prefill))
    bm = sched.block_manager
    bm.check_invariants([])
    if not caching:
        assert bm.num_free_blocks == bm.num_blocks
    for s in seqs:
        assert s.status == SequenceStatus.FINISHED and s.block_table == []
        expected = min(s.sampling_params.max_tokens, max(1, 300 - s.num_prompt_tokens))
        assert s.num_completion_tokens == expected and s.finish_reason == "length"


KV_CASES = {
    # two prompts share 35 tokens (2 full blocks); with 16-token chunks the first computes them over two steps,
    # while the second is admitted in the first step
    "shared-prefix": dict(num_blocks=64, budget=48, cap=16,
                          prompts=[(list(range(100, 135)) + [1, 2], 4), (list(range(100, 135)) + [3, 4], 4)]),
    # a 60-token prompt prefills beside a decode (no cap); the decode needs a block and preempts it after 16
    # of its tokens; when it comes back it finds its own 3 full blocks
    "preempted-mid-prefill": dict(num_blocks=5, budget=8, cap=0,
                                  prompts=[(list(range(100, 114)), 10), (list(range(200, 260)), 4)]),
}


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
@pytest.mark.parametrize("case", list(KV_CASES))
def test_prefix_hits_read_only_computed_kv(case, mixed):
    """With prefix caching, every cached position a step's rows attend to must already hold that sequence's
    own prefix: written by an earlier step, or by this one (each layer stores the step's keys and values
    before it attends). The fake model tracks which token prefix each cache slot holds."""
    spec = KV_CASES[case]
    sched = make(num_blocks=spec["num_blocks"], caching=True, mixed_steps=mixed,
                 max_num_batched_tokens=spec["budget"], long_prefill_token_threshold=spec["cap"])
    seqs = [Sequence(prompt, Params(max_tokens=max_tokens), 16) for prompt, max_tokens in spec["prompts"]]
    for s in seqs:
        sched.add(s)
    kv: dict[int, tuple[int, ...]] = {}  # cache slot -> the token prefix whose last key/value it holds
    steps = []

    def slot(s, p):
        return s.block_table[p // s.block_size] * s.block_size + p % s.block_size

    def check(_, batch, is_prefill):
        steps.append([(s.seq_id - seqs[0].seq_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in batch])
        for s in batch:
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                kv[slot(s, p)] = tuple(s.token_ids[:p + 1])
        for s in batch:
            stale = [p for p in range(s.num_computed_tokens) if kv.get(slot(s, p)) != tuple(s.token_ids[:p + 1])]
            assert not stale, (
                f"step {len(steps) - 1}: sequence {s.seq_id - seqs[0].seq_id} attends positions {stale[0]}..{stale[-1]} "
                f"of its context (num_computed_tokens={s.num_computed_tokens} after prefix-cache hits, "
                f"{s.num_preemptions} preemptions) that no step computed; steps so far as (seq, computed, "
                f"scheduled): {steps}")

    run(sched, random.Random(0), on_step=check)
    assert all(s.is_finished for s in seqs)
    if case == "shared-prefix":
        assert seqs[1].num_cached_tokens > 0
    else:
        assert sched.num_preemptions > 0


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "separate"])
def test_prompt_preempted_mid_prefill_keeps_greedy_output(mixed):
    """The engine version of "preempted-mid-prefill" above (tiny model, async scheduling on): the preempted
    prompt must come back to the same greedy tokens as transformers."""
    first = list(encode(SHARED_TEXT))[:14]
    second = list(encode("This module provides a class that " * 10))[:60]
    llm = LLM(TINY, mixed_steps=mixed, num_kvcache_blocks=5, kvcache_block_size=16, max_num_batched_tokens=8,
              long_prefill_token_threshold=0)
    params = [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0, max_tokens=20)]
    outs = llm.generate([first, second], params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    expected = [hf_greedy(TINY, [first], 10)[0], hf_greedy(TINY, [second], 20)[0]]
    got = [o["token_ids"] for o in outs]
    assert got == expected, (f"got {got}, expected {expected} (num_cached_tokens "
                             f"{[o['num_cached_tokens'] for o in outs]})")


# ------------------------------------------------------------------------------------------------------------
# 4. the settings are validated by name
@pytest.mark.parametrize("kwargs, match", [
    (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an integer >= 0.*got -1"),
    (dict(long_prefill_token_threshold=1.5), r"long_prefill_token_threshold must be an integer >= 0.*got 1.5"),
    (dict(long_prefill_token_threshold=True), r"long_prefill_token_threshold must be an integer >= 0.*got True"),
    (dict(mixed_steps="yes"), r"mixed_steps must be True or False, got 'yes'"),
], ids=["threshold=-1", "threshold=1.5", "threshold=True", "mixed_steps='yes'"])
def test_bad_mixed_setting_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Config(TINY, **kwargs)


def test_threshold_zero_means_no_cap():
    config = Config(TINY, max_num_batched_tokens=48, long_prefill_token_threshold=0, mixed_steps=True)
    assert Scheduler(config, make_block_manager(8, 256, False)).chunk_cap == 48


# ------------------------------------------------------------------------------------------------------------
# 5. a mixed step's inputs, and its attention equal to two separate steps
@pytest.fixture(scope="module")
def runner():
    return ModelRunner(Config(TINY, kvcache_block_size=16, num_kvcache_blocks=32, device="cpu"))


def mixed_steps_of_a_scheduler():
    """Two mixed steps of a real scheduler: step A = decode [b] + chunks [a (4 of 20, completes), c (16 of 40),
    d (10, completes)]; step B = decodes [a, d, b] + chunk [c (16 more)]."""
    config = Config(TINY, kvcache_block_size=16, max_num_batched_tokens=48, long_prefill_token_threshold=16,
                    mixed_steps=True)
    sched = Scheduler(config, make_block_manager(32, 16, False))
    a, b = Sequence(list(range(10, 30)), Params(max_tokens=8), 16), Sequence(list(range(40, 45)), Params(max_tokens=8), 16)
    c, d = Sequence(list(range(50, 90)), Params(max_tokens=8), 16), Sequence(list(range(90, 100)), Params(max_tokens=8), 16)
    sched.add(a)
    sched.add(b)
    seqs, _ = sched.schedule()  # a: 16 of 20, b: 5 (complete)
    assert [s.num_scheduled_tokens for s in seqs] == [16, 5]
    sched.postprocess(seqs, [7])
    sched.add(c)
    sched.add(d)
    order = []
    for _ in range(2):
        seqs, is_prefill = sched.schedule()
        order.append([s.seq_id for s in seqs])
        yield seqs, is_prefill
        sched.postprocess(seqs, [7] * len(completing(seqs)))
    assert order == [[b.seq_id, a.seq_id, c.seq_id, d.seq_id], [a.seq_id, d.seq_id, b.seq_id, c.seq_id]]


def expected_inputs(seqs, n, bs=16):
    ids, pos, slots, cu_q, cu_k, logits = [], [], [], [0], [0], list(range(n))
    for i, s in enumerate(seqs):
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
        ids += s.token_ids[start:end]
        pos += list(range(start, end))
        slots += [s.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        if i >= n:
            cu_q.append(cu_q[-1] + end - start)
            cu_k.append(cu_k[-1] + end)
            if end == s.num_tokens:
                logits.append(n + cu_q[-1] - 1)
    return ids, pos, slots, cu_q, cu_k, logits


def test_prepare_mixed_rows_and_attention_equal_two_separate_steps(runner):
    backend = get_attention_backend("torch", torch.device("cpu"), 16)
    heads, kv_heads, dim, blocks = 4, 2, 64, 32
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, blocks, 16, kv_heads, dim, generator=gen)  # stands for the earlier steps' keys/values
    for k, (seqs, is_prefill) in enumerate(mixed_steps_of_a_scheduler()):
        n = num_decode_rows(seqs)
        assert is_prefill and 0 < n < len(seqs) and n == (1 if k == 0 else 3)
        step = runner.prepare_mixed(seqs, n)
        assert runner.prepare_step(ScheduledBatch(seqs, is_prefill)).input_ids.tolist() == step.input_ids.tolist()
        assert step.is_mixed and step.num_decode_rows == n and step.num_seqs == len(seqs)
        ids, pos, slots, cu_q, cu_k, logits = expected_inputs(seqs, n)
        assert step.input_ids.tolist() == ids and step.positions.tolist() == pos
        assert step.slot_mapping.tolist() == slots
        assert step.logits_indices.tolist() == logits
        assert step.logits_indices.tolist() == ([0, 4, 30] if k == 0 else [0, 1, 2])
        assert step.cu_seqlens_q.tolist() == [n + c for c in cu_q] and step.cu_seqlens_k.tolist() == cu_k  # q: from row 0
        assert step.max_seqlen_q == max(b - a for a, b in pairwise(cu_q))
        assert step.max_seqlen_k == max(b - a for a, b in pairwise(cu_k))
        assert step.block_tables.shape == (len(seqs), max(len(s.block_table) for s in seqs))
        dec, chunks = step.decode_rows, step.chunk_rows
        assert not dec.is_prefill and dec.input_ids.tolist() == ids[:n] and dec.positions.tolist() == pos[:n]
        assert dec.context_lens.tolist() == [s.num_tokens for s in seqs[:n]]
        assert dec.slot_mapping.tolist() == slots[:n] and dec.block_tables.shape[0] == n
        assert chunks.is_prefill and chunks.num_decode_rows == 0 and chunks.input_ids.tolist() == ids[n:]
        assert chunks.positions.tolist() == pos[n:] and chunks.slot_mapping.tolist() == slots[n:]
        assert chunks.cu_seqlens_q[0] == 0 and chunks.cu_seqlens_q[-1] == len(ids) - n
        assert chunks.cu_seqlens_k.tolist() == cu_k and chunks.block_tables.shape[0] == len(seqs) - n
        for row, s in enumerate(seqs):
            assert step.block_tables[row, :len(s.block_table)].tolist() == s.block_table
        assert (dec.block_tables == step.block_tables[:n]).all() and (chunks.block_tables == step.block_tables[n:]).all()

        # the same attention as the decode rows' own decode step, then the chunks' own prefill step
        T = len(ids)
        q = torch.randn(T, heads, dim, generator=gen)
        kk, vv = torch.randn(T, kv_heads, dim, generator=gen), torch.randn(T, kv_heads, dim, generator=gen)
        plain = Attention(heads, dim, dim ** -0.5, kv_heads)
        one, two = cache.clone(), cache.clone()
        mixed_out = PagedAttention(plain, one[0], one[1], backend)(q, kk, vv, step)
        separate = PagedAttention(plain, two[0], two[1], backend)
        dstep, cstep = runner.prepare_decode(seqs[:n]), runner.prepare_prefill(seqs[n:])
        out = torch.cat([separate(q[:n], kk[:n], vv[:n], dstep), separate(q[n:], kk[n:], vv[n:], cstep)])
        assert mixed_out.shape == (T, heads, dim)
        torch.testing.assert_close(mixed_out, out, atol=1e-5, rtol=1e-5)
        assert torch.equal(one, two)  # both stored the same keys and values
        cache = one
