"""The online engine (notebook 21): requests submitted while the loop runs give transformers' greedy tokens,
aborted neighbours change nothing and give their blocks back, streams add up to the results, metrics are
ordered, bad requests fail in the caller's thread, errors and shutdown end every stream."""
import asyncio
import threading
import time

import pytest

from nanovllm_edu import SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.online import OnlineLLM

from parity import hf_greedy

PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the given",
           "Create a new", "If the file does not exist, the function returns None and logs a warning; otherwise"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
MARKS = ["arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    engine = OnlineLLM(tiny_model_path(), async_scheduling=request.param, max_num_seqs=4, num_kvcache_blocks=48,
                       kvcache_block_size=16)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def reference(llm):
    return hf_greedy(tiny_model_path(), [llm.tokenizer.encode(p) for p in PROMPTS], GREEDY.max_tokens)


def wait_until_idle(llm, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (llm.live or llm.block_manager.num_free_blocks != llm.block_manager.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.live and llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_requests_added_while_running_match_transformers(llm, reference):
    first = llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    next(iter(first))  # the loop is decoding it
    streams = []
    for prompt in PROMPTS:  # arrive one by one while the engine runs
        streams.append(llm.submit(prompt, GREEDY))
        time.sleep(0.005)
    assert [s.result(timeout=60)["token_ids"] for s in streams] == reference
    assert first.result(timeout=60)["finish_reason"] == "length"
    wait_until_idle(llm)


def test_aborted_neighbours_change_nothing_and_free_their_blocks(llm, reference):
    noisy = [llm.submit(PROMPTS[4] * 2, SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True))
             for _ in range(3)]
    streams = [llm.submit(p, GREEDY) for p in PROMPTS]
    for s in noisy:
        next(iter(s))
        s.abort()
    assert [s.result(timeout=60)["token_ids"] for s in streams] == reference
    for s in noisy:
        out = s.result(timeout=60)
        assert out["finish_reason"] == "abort" and len(out["token_ids"]) < 200
    wait_until_idle(llm)


def test_stream_text_adds_up_to_the_result(llm):
    params = SamplingParams(temperature=0, max_tokens=30, stop=[" the", "\n"])
    stream = llm.submit(PROMPTS[1], params)
    outputs = list(stream)
    assert "".join(o.text for o in outputs) == stream.final["text"]
    assert [t for o in outputs for t in o.token_ids] == stream.final["token_ids"]
    assert outputs[-1].result is stream.final and outputs[-1].finish_reason == stream.final["finish_reason"]
    assert all(a.time <= b.time for a, b in zip(outputs, outputs[1:]))


@pytest.mark.parametrize("fields", [dict(skip_special_tokens=False, ignore_eos=True),
                                    dict(stop=[" is", "\n"], include_stop_str_in_output=True),
                                    dict(stop=" is", include_stop_str_in_output=True, skip_special_tokens=False)])
def test_streams_show_the_text_the_result_shows(llm, fields):
    params = SamplingParams(temperature=0, max_tokens=14, **fields)
    stream = llm.submit("Raise ValueError if the", params)
    outputs = list(stream)
    assert "".join(o.text for o in outputs) == stream.final["text"] and stream.final["text"]
    if params.include_stop_str_in_output:  # the result keeps the stop string: nothing is held back
        assert stream.held_chars == 0 and stream.final["text"].endswith(stream.final["stop_reason"])
        assert all(o.text for o in outputs if o.token_ids)  # each token's text shown as it arrives
    if params.ignore_eos:  # the EOS inside the completion, shown as it arrives
        assert llm.tokenizer.eos_token in "".join(o.text for o in outputs[:-1])


def test_async_consumers_and_n_completions(llm):
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=12, ignore_eos=True, logprobs=1)

    async def consume(prompt):
        stream = llm.submit(prompt, params)
        texts, tokens = ["", ""], [[], []]
        async for out in stream:
            texts[out.index] += out.text
            tokens[out.index] += out.token_ids
            assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        return stream.final, texts, tokens

    async def main():
        return await asyncio.gather(*[consume(p) for p in PROMPTS[:3]])

    for final, texts, tokens in asyncio.run(main()):
        assert [o["text"] for o in final["outputs"]] == texts
        assert [o["token_ids"] for o in final["outputs"]] == tokens
    wait_until_idle(llm)


def test_metrics_are_ordered(llm):
    start = time.monotonic()
    results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for result in results:
        times = [result["metrics"][name] for name in MARKS]
        assert start <= times[0] and times == sorted(times) and times[-1] <= time.monotonic()


def test_bad_requests_fail_in_the_callers_thread(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.submit([10 ** 9])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    live = llm.submit(PROMPTS[0], GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        llm.submit(PROMPTS[0], GREEDY, request_id="dup")
    assert live.result(timeout=60)["finish_reason"] in ("stop", "length")
    assert llm.submit(PROMPTS[0], GREEDY, request_id="dup").result(timeout=60)  # free again once it ended


def test_submissions_from_many_threads(llm, reference):
    results = {}

    def client(i):
        results[i] = llm.submit(PROMPTS[i % len(PROMPTS)], GREEDY).result(timeout=120)["token_ids"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(12)] == [reference[i % len(PROMPTS)] for i in range(12)]
    wait_until_idle(llm)


def test_a_failing_step_ends_every_stream_and_the_engine_serves_on():
    llm = OnlineLLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    broken = {"on": True}
    launch = llm.model_runner.launch

    def failing_launch(batch):  # a ScheduledBatch
        if broken["on"]:
            raise RuntimeError("injected failure")
        return launch(batch)

    llm.model_runner.launch = failing_launch
    stream = llm.submit(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="injected failure"):
        stream.result(timeout=30)
    with pytest.raises(RuntimeError, match="injected failure"):  # asked again: raised again, never a hang
        stream.result(timeout=5)
    with pytest.raises(RuntimeError, match="injected failure"):
        list(stream)
    broken["on"] = False
    assert llm.submit(PROMPTS[0], GREEDY).result(timeout=30)["finish_reason"] in ("stop", "length")
    wait_until_idle(llm)
    llm.exit()


def test_shutdown_aborts_live_requests_and_refuses_new_ones():
    llm = OnlineLLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    stream = llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=700, ignore_eos=True))
    next(iter(stream))
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5 and not llm.loop_thread.is_alive()
    assert stream.result(timeout=1)["finish_reason"] == "abort"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    with pytest.raises(RuntimeError, match="shutting down"):
        llm.submit(PROMPTS[0])
    llm.shutdown()  # twice is fine
    llm.exit()


def test_a_consumer_whose_event_loop_closed_harms_no_one():
    llm = OnlineLLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    bystander = llm.submit(PROMPTS[0], long)
    left = llm.submit(PROMPTS[1], long)

    async def first_output(stream):
        async for out in stream:
            return out  # stops reading; asyncio.run then closes its event loop while the request is live

    asyncio.run(first_output(left))
    assert bystander.result(timeout=60)["finish_reason"] == "length"
    assert left.result(timeout=60)["finish_reason"] == "length"  # its outputs waited in the queue
    assert llm.loop_thread.is_alive() and llm.submit(PROMPTS[2], GREEDY).result(timeout=30)
    wait_until_idle(llm)
    llm.exit()


def test_a_late_abort_of_an_ended_stream_spares_the_request_that_reuses_its_id():
    llm = OnlineLLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    old = llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), request_id="chat-42")
    old.result(timeout=30)
    new = llm.submit(PROMPTS[3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), request_id="chat-42")
    old.abort()  # a late clean-up of the finished stream
    assert new.result(timeout=30)["finish_reason"] == "length" and len(new.final["token_ids"]) == 40
    llm.exit()


def test_an_abort_right_after_submit_leaves_nothing_running():
    llm = OnlineLLM(tiny_model_path(), num_kvcache_blocks=48, kvcache_block_size=16)
    llm.submit(PROMPTS[0], SamplingParams(max_tokens=1)).result(timeout=30)  # the loop runs
    start = llm.start

    def start_then_abort_from_another_thread():  # another thread's abort, at the earliest moment it could come
        start()
        if "victim" in llm.live:
            other = threading.Thread(target=llm.abort, args=("victim",))
            other.start()
            other.join()

    llm.start = start_then_abort_from_another_thread
    stream = llm.submit(PROMPTS[3], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), request_id="victim")
    assert stream.result(timeout=30)["finish_reason"] == "abort"
    wait_until_idle(llm)
    assert llm.is_finished()  # not decoding it for nobody
    llm.exit()
