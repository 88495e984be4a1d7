"""Notebook 11: the engine trace is an opt-in observer, leaves the engine as it was, and records what each step did."""
import importlib.util
import json
from pathlib import Path

import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.bench import StepTimer
from nanovllm_edu.engine.observer import ObserverGroup, StepObserver
from nanovllm_edu.course.figures import SMALL_CACHE_ARGS, small_cache_requests, trace_tiny_cpu
from nanovllm_edu.course.trace import (EngineTrace, load_trace, relabel, save_trace, step_times, summarize,
                                      trace_to_dict)

from helpers import without_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return LLM(tiny_model_path(), **SMALL_CACHE_ARGS)


def run_traced(llm):
    prompts, params = small_cache_requests()
    before = llm.scheduler.num_preemptions
    with EngineTrace(llm) as trace:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return trace, outs, llm.scheduler.num_preemptions - before


def test_trace_off_costs_nothing_and_changes_nothing(small):
    prompts, params = small_cache_requests()
    plain = small.generate(prompts, params, use_tqdm=False)
    trace, traced, _ = run_traced(small)
    assert without_metrics(traced) == without_metrics(plain)
    # after the trace nothing of it is left: the engine holds the do-nothing observer again
    assert type(small.observer) is StepObserver and type(small.model_runner.observer) is StepObserver
    assert "step" not in vars(small) and "schedule" not in vars(small.scheduler)
    assert not trace.active
    n = len(trace.records)
    small.generate(prompts[:1], params[:1], use_tqdm=False)
    assert len(trace.records) == n  # stopped traces record nothing


def test_records_describe_the_steps(small):
    trace, outs, preemptions = run_traced(small)
    records = trace.records
    budget = small.scheduler.max_num_batched_tokens
    assert preemptions > 0 and sum(len(r.preempted) for r in records) == preemptions
    for r in records:
        assert r.kind in ("prefill", "decode") and r.batch_size == len(r.chunks) > 0
        assert 0 < r.used_blocks <= r.total_blocks == SMALL_CACHE_ARGS["num_kvcache_blocks"]
        assert r.num_tokens <= budget
        if r.kind == "decode":
            assert r.chunks == [1] * r.batch_size
        assert r.seconds >= 0
    times = step_times(records)
    assert times["prefill"]["steps"] + times["decode"]["steps"] == len(records)
    assert times["decode"]["seconds"] > 0 and times["decode"]["ms_per_token"] > 0
    finished = [i for r in records for i in r.finished]
    assert sorted(finished) == sorted(set(finished)) and len(finished) == len(outs)
    # every generated token came out of a step that completed a prefill or decoded
    assert summarize(records)["decode_tokens"] <= sum(len(o["token_ids"]) for o in outs)


def test_relabelled_traces_compare_across_runs(small):
    a, _, _ = run_traced(small)
    b, _, _ = run_traced(small)
    assert a.records[0].seq_ids != b.records[0].seq_ids  # raw ids are process-wide counters
    assert trace_to_dict(a.records) == trace_to_dict(b.records)
    assert relabel(a.records)[0].seq_ids[0] == 0


def test_save_and_load(small, tmp_path):
    trace, _, _ = run_traced(small)
    path = tmp_path / "trace.json"
    save_trace(trace.records, path, note="x")
    data = json.loads(path.read_text())
    assert data["note"] == "x" and "seconds" not in data["records"][0]
    loaded = load_trace(path)
    assert loaded == [r.__class__(**{**vars(r), "seconds": 0.0}) for r in relabel(trace.records)]
    save_trace(trace.records, path, timings=True)
    assert "seconds" in json.loads(path.read_text())["records"][0]


def test_nests_with_other_observers(small):
    """A StepTimer (the benchmark's) and a trace on the same engine: both see every step, both detach."""
    prompts, params = small_cache_requests()
    with small.observe(StepTimer(small)) as timer:
        with small.observe(EngineTrace(small, start=False)) as trace:
            assert isinstance(small.observer, ObserverGroup)
            small.generate(prompts[:2], params[:2], use_tqdm=False)
        assert small.observer is timer  # the timer alone watches again
        with EngineTrace(small) as inner:  # the trace's own `with` nests the same way
            small.generate(prompts[:1], params[:1], use_tqdm=False)
        assert small.observer is timer and not inner.active
    assert type(small.observer) is StepObserver
    assert "step" not in vars(small) and "schedule" not in vars(small.scheduler)
    steps = timer.totals["prefill"]["steps"] + timer.totals["decode"]["steps"]
    assert steps == len(trace.records) + len(inner.records) and len(trace.records) > 0 and len(inner.records) > 0


def test_start_stop_rounds_accumulate(small):
    prompts, params = small_cache_requests()
    trace = EngineTrace(small, start=False)
    assert not trace.active and type(small.observer) is StepObserver
    for _ in range(2):
        trace.start().start()  # starting twice attaches once
        assert small.observer is trace
        small.generate(prompts[:1], params[:1], use_tqdm=False)
        trace.stop()
        trace.stop()
        assert type(small.observer) is StepObserver
    kinds = [r.kind for r in trace.records]
    assert kinds.count("prefill") == 2 and [r.step for r in trace.records] == list(range(len(kinds)))


def test_make_figures_reproduces_the_committed_trace(tmp_path, monkeypatch):
    """`python scripts/make_figures.py` is deterministic: the committed JSON is what it writes today."""
    pytest.importorskip("matplotlib")  # the notebooks extra: make_figures.py draws the PNGs
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    make_figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_figures)
    monkeypatch.setattr(make_figures, "FIGURES", tmp_path)
    (tmp_path / "cuda_graphs.json").write_text((ROOT / "figures" / "cuda_graphs.json").read_text())
    assert make_figures.main([]) == 0
    assert (tmp_path / "trace_tiny_cpu.png").stat().st_size > 0 and (tmp_path / "cuda_graphs.png").exists()
    assert json.loads((tmp_path / "trace_tiny_cpu.json").read_text()) == \
        json.loads((ROOT / "figures" / "trace_tiny_cpu.json").read_text())
    records, _ = trace_tiny_cpu()
    assert summarize(records)["preemptions"] > 0


def test_a_step_in_flight_when_the_trace_attaches_is_not_recorded(small):
    small.add_request("Return the", SamplingParams(temperature=0, max_tokens=3))
    inflight = small.launch()  # the engine is mid-step (async scheduling launches one ahead) ...
    with EngineTrace(small) as trace:  # ... when the trace attaches
        small.complete(inflight)
        while not small.is_finished():
            small.step()
    assert [r.kind for r in trace.records] == ["decode", "decode"]
