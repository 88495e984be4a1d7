"""Notebook 11: `stream` yields generate's tokens and text, validates up front, and aborts cleanly."""
import gc

import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.course.streaming import StreamEvent, stream, stream_texts

from helpers import without_metrics

PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the given", "def main():"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_path(), num_kvcache_blocks=32, kvcache_block_size=16)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def assert_idle(llm):
    bm = llm.block_manager
    assert llm.is_finished() and bm.num_free_blocks == bm.num_blocks and not bm.used_block_ids


def test_stream_equals_generate(llm, reference):
    events = list(stream(llm, PROMPTS, GREEDY))
    assert all(isinstance(e, StreamEvent) for e in events)
    for i, ref in enumerate(reference):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == ref["token_ids"]
        assert "".join(e.text for e in mine) == ref["text"]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == ref["finish_reason"] and mine[0].finish_reason is None
    assert stream_texts(llm, PROMPTS, GREEDY) == [r["text"] for r in reference]
    assert_idle(llm)


def test_per_prompt_params_and_a_bare_prompt(llm, reference):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 5)]
    events = list(stream(llm, PROMPTS[:2], params))
    assert [sum(e.index == i for e in events) for i in range(2)] == [3, 5]
    bare = [e.token_id for e in stream(llm, PROMPTS[0], GREEDY)]
    assert bare == reference[0]["token_ids"]


def test_partially_consumed_stream_leaves_engine_usable(llm, reference):
    events = stream(llm, PROMPTS, GREEDY)
    for _ in range(6):
        next(events)
    assert not llm.is_finished()  # requests are in flight
    events.close()
    assert_idle(llm)
    assert without_metrics(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == without_metrics(reference)


def test_break_and_consumer_error_abort(llm, reference):
    for event in stream(llm, PROMPTS, GREEDY):
        if event.index == 1:
            break
    gc.collect()  # the abandoned generator is closed when collected (CPython: at once)
    assert_idle(llm)
    with pytest.raises(KeyError):
        for event in stream(llm, PROMPTS, GREEDY):
            raise KeyError("consumer failed")
    gc.collect()
    assert_idle(llm)
    assert without_metrics(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == without_metrics(reference)


def test_engine_error_aborts(llm, reference, monkeypatch):
    calls = {"n": 0}
    step = llm.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return step()

    monkeypatch.setattr(llm, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        list(stream(llm, PROMPTS, GREEDY))
    monkeypatch.undo()
    assert_idle(llm)
    assert without_metrics(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == without_metrics(reference)


@pytest.mark.parametrize("prompts, params, match", [
    (["Return the", ""], GREEDY, "empty"),
    (["Return the", [1, 2, 10**9]], GREEDY, "vocabulary"),
    (PROMPTS, [GREEDY, GREEDY], "SamplingParams"),
    ([], GREEDY, "at least one prompt"),
])
def test_every_request_is_validated_before_any_runs(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        stream(llm, prompts, params)  # raises at the call, not at the first next()
    assert_idle(llm)


def test_unstarted_stream_queues_nothing(llm):
    events = stream(llm, PROMPTS, GREEDY)
    assert_idle(llm)
    del events
    gc.collect()
    assert_idle(llm)


def test_stream_leaves_other_requests_alone(llm, reference):
    """A request queued before the stream keeps running after the stream's own requests finish."""
    other = llm.add_request("Create a new", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    events = list(stream(llm, PROMPTS, GREEDY))
    assert [[e.token_id for e in events if e.index == i] for i in range(len(PROMPTS))] == \
        [r["token_ids"] for r in reference]
    assert [s.seq_id for s in llm.scheduler.running] == [other]
    while not llm.is_finished():
        llm.step()
    assert_idle(llm)


def test_bare_token_id_prompt(llm):
    ids = llm.tokenizer.encode("Return the")
    ref = llm.generate(ids, GREEDY, use_tqdm=False)
    assert stream_texts(llm, ids, GREEDY) == [ref[0]["text"]]
    assert [e.token_id for e in stream(llm, ids, GREEDY)] == ref[0]["token_ids"]


def split_events(events, n):
    return [[e for e in events if e.index == i] for i in range(n)]


@pytest.mark.parametrize("how", ["close", "break"])
def test_interleaved_streams_are_independent(llm, reference, how):
    """Dropping one of two interleaved streams aborts only its requests; the other runs to its finished
    events with the tokens it gets alone, and every block comes back."""
    second = stream(llm, PROMPTS[2:], GREEDY)
    got = []
    if how == "close":
        first = stream(llm, PROMPTS[:2], GREEDY)
        for _ in range(5):
            next(first)
            got.append(next(second))
        first.close()
    else:
        for n, _ in enumerate(stream(llm, PROMPTS[:2], GREEDY)):  # the second is consumed inside this loop
            got.append(next(second))
            if n == 4:
                break
        gc.collect()
    # only the second stream's two requests are left, none aborted
    assert len(llm.scheduler.running) + len(llm.scheduler.waiting) == 2
    assert all(s.finish_reason is None for s in (*llm.scheduler.running, *llm.scheduler.waiting))
    got += list(second)
    for mine, ref in zip(split_events(got, 2), reference[2:]):
        assert [e.token_id for e in mine] == ref["token_ids"]
        assert "".join(e.text for e in mine) == ref["text"]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == ref["finish_reason"]
    assert_idle(llm)


def test_stream_outlives_one_finished_by_another_streams_steps(llm, reference):
    """Tokens made by another stream's steps (even the last ones) are still yielded, finished included."""
    first, second = stream(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2)), stream(llm, PROMPTS[1:], GREEDY)
    e0 = next(first)  # queues and runs the first prefill
    rest_second = list(second)  # its steps finish the first stream's request too
    rest_first = list(first)
    assert [e.token_id for e in [e0] + rest_first] == reference[0]["token_ids"][:2] and rest_first[-1].finished
    assert [[e.token_id for e in m] for m in split_events(rest_second, 3)] == [r["token_ids"] for r in reference[1:]]
    assert_idle(llm)


def test_abort_all_elsewhere_ends_a_stream_with_an_error(llm, reference):
    events = stream(llm, PROMPTS, GREEDY)
    next(events)
    llm.abort_all()
    with pytest.raises(RuntimeError, match="aborted outside"):
        list(events)
    assert_idle(llm)


def test_engine_abort_frees_waiting_and_half_prefilled_requests():
    engine = LLM(tiny_model_path(), num_kvcache_blocks=16, kvcache_block_size=16, max_num_batched_tokens=8,
                 max_num_seqs=1)
    long_prompt = list(range(1, 30))
    half, queued = engine.make_requests([long_prompt, "Return the"], GREEDY)
    for seq in (half, queued):
        engine.scheduler.add(seq)
    engine.step()
    assert engine.scheduler.prefilling is half and queued in engine.scheduler.waiting
    engine.abort_sequences([half, queued])
    assert engine.scheduler.prefilling is None and engine.is_finished()
    assert half.finish_reason == queued.finish_reason == "abort"
    assert_idle(engine)
    assert engine.generate("def main():", GREEDY, use_tqdm=False)[0]["token_ids"] == \
        LLM(tiny_model_path(), num_kvcache_blocks=16, kvcache_block_size=16).generate(
            "def main():", GREEDY, use_tqdm=False)[0]["token_ids"]


def test_streams_in_two_threads_match_their_single_thread_runs():
    """Two threads, each consuming its own stream of one engine: each gets what it gets alone."""
    import threading
    llm = LLM(tiny_model_path(), device="cpu", max_num_seqs=8, num_kvcache_blocks=32, kvcache_block_size=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    jobs = [["Return the", "Create a new"], ["This module provides"]]
    alone = [stream_texts(llm, prompts, params) for prompts in jobs]
    got = [None, None]

    def run(i):
        got[i] = stream_texts(llm, jobs[i], params)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == alone
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_streams_hold_back_a_stop_string_under_way(llm, reference):
    """A stream never shows the start of a stop string that then ends the request: its text is generate's."""
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[ref["text"][3:9], "zzzz"]) for ref in reference]
    params += [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[reference[0]["token_ids"][2]])]
    prompts = PROMPTS + PROMPTS[:1]
    expected = llm.generate(prompts, params, use_tqdm=False)
    events = list(stream(llm, prompts, params))
    for i, ref in enumerate(expected):
        mine = [e for e in events if e.index == i]
        assert "".join(e.text for e in mine) == ref["text"] and [e.token_id for e in mine] == ref["token_ids"]
        assert mine[-1].finish_reason == "stop"
    assert_idle(llm)
