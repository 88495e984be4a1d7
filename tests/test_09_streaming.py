"""Notebook 09: `stream` yields generate's tokens and text, validates up front, and aborts cleanly."""
import gc

import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.course.streaming import StreamEvent, stream, stream_texts

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
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False) == reference


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
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False) == reference


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
    assert llm.generate(PROMPTS, GREEDY, use_tqdm=False) == reference


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
