"""generate's input checks (issue 12, items 2 and 5): every bad call is refused before any work with a
message naming the problem, the engine carries on; add_request + generate refuses instead of dropping a
result; the progress bar's windowed rate; the CPU KV cache sized from max_model_len and max_num_seqs."""
import logging

import numpy as np
import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import Config
from nanovllm_edu.engine.llm_engine import StepResult, TokenRate
from nanovllm_edu.engine.model_runner import CPU_KV_BUDGET_BYTES, ModelRunner

from helpers import without_metrics

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_path(), device="cpu", max_num_seqs=8, num_kvcache_blocks=64, kvcache_block_size=16)


def assert_idle(llm):
    assert llm.is_finished()
    assert llm.block_manager.num_free_blocks == llm.model_runner.num_kvcache_blocks


@pytest.mark.parametrize("prompts, params, error, match", [
    (["Return the"], [], ValueError, r"got 0 SamplingParams for 1 prompts"),
    (None, GREEDY, ValueError, r"prompts is None"),
    ([[1.0, 2.0]], GREEDY, ValueError, r"2 of its ids are floats \(first: 1\.0\)"),
    ([1.0, 2.0], GREEDY, ValueError, r"are floats"),
    (np.array([1.5, 2.0]), GREEDY, ValueError, r"are floats"),
    (["Return the"], {"temperature": 0}, ValueError, r"got dict; pass SamplingParams\(\*\*\{'temperature': 0\}\)"),
    (["Return the", "Create"], [GREEDY, {"temperature": 0}], ValueError, r"must be SamplingParams, got dict"),
    ([{"text": "hi"}], GREEDY, ValueError, r"string or a list of token ids \(ints\), got dict"),
    (42, GREEDY, ValueError, r"prompts must be a string, a list of token ids, or a list of those; got int"),
    ([[True, 2]], GREEDY, ValueError, r"of type bool"),
])
def test_bad_calls_are_refused_before_any_work(llm, monkeypatch, prompts, params, error, match):
    def no_work(*args, **kwargs):
        raise AssertionError("the model ran")
    monkeypatch.setattr(llm.model_runner, "launch", no_work)
    monkeypatch.setattr(llm.model_runner, "run", no_work)
    with pytest.raises(error, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)


def test_numpy_token_ids_are_accepted(llm):
    ids = llm.tokenizer.encode("Return the")
    expected = llm.generate([ids], GREEDY, use_tqdm=False)[0]["token_ids"]
    for prompt in (np.array(ids), [np.array(ids)], np.array([ids]), [[np.int64(t) for t in ids]]):
        assert [o["token_ids"] for o in llm.generate(prompt, GREEDY, use_tqdm=False)] == [expected]


def test_generate_refuses_while_add_request_results_are_queued(llm):
    alone = llm.generate(["Create a new"], GREEDY, use_tqdm=False)
    seq_id = llm.add_request("Return the", GREEDY)
    with pytest.raises(RuntimeError, match=r"1 request\(s\) already queued .*abort_all"):
        llm.generate(["Create a new"], GREEDY, use_tqdm=False)
    assert [s.seq_id for s in llm.scheduler.waiting] == [seq_id]  # the queued request is untouched
    finished = [seq for step in llm.steps() for seq in step.finished]
    assert [s.seq_id for s in finished] == [seq_id]
    assert_idle(llm)
    assert without_metrics(llm.generate(["Create a new"], GREEDY, use_tqdm=False)) == without_metrics(alone)


def test_token_rate_is_smoothed_over_a_window():
    meter = TokenRate(start=0.0, window=0.5)
    for k in range(1, 11):  # 20 decode tokens every 0.1 s: 200 tok/s
        rates = meter.update(k / 10, StepResult([], 20, is_prefill=False))
    assert rates["decode"] == pytest.approx(200) and rates["prefill"] == 0
    spike = meter.update(1.0001, StepResult([], 20, is_prefill=False))["decode"]  # a step finishing right after the last: naive 200,000 tok/s
    assert 200 <= spike < 250
    assert meter.update(1.2, StepResult([], 300, is_prefill=True))["prefill"] == pytest.approx(300 / 0.5, rel=0.05)
    assert len(meter.marks) <= 8  # only the window is kept


def test_token_rate_of_one_long_step():
    meter = TokenRate(start=10.0)
    assert meter.update(12.0, StepResult([], 1000, is_prefill=True)) == {"prefill": 500.0, "decode": 0.0}


def test_cpu_kv_cache_sized_from_max_model_len_and_max_num_seqs(caplog):
    caplog.set_level(logging.INFO, logger="nanovllm_edu.engine.model_runner")
    runner = ModelRunner(Config(tiny_model_path(), device="cpu", kvcache_block_size=16, max_num_seqs=2,
                                max_model_len=100))
    assert runner.num_kvcache_blocks == 2 * 7 == runner.max_useful_blocks()  # ceil(100 / 16) = 7 per sequence
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == 14 * runner.block_bytes()
    assert "KV cache: 14 blocks of 16 tokens = 0.9 MiB on cpu" in caplog.text
    assert runner.block_bytes() * runner.num_kvcache_blocks <= CPU_KV_BUDGET_BYTES
