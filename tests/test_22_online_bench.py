"""The online benchmark (notebook 22): Poisson arrivals, latency statistics, a tiny-model run on a CPU at two
rates, its JSON and plot, the stall timeline, and the command line."""
import math
import statistics
from itertools import pairwise

import pytest

pytest.importorskip("matplotlib")  # nanovllm_edu.bench.online draws its figures with it (the notebooks extra)

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.bench.online import (BURST, LATENCY_KEYS, arrival_times, latency_stats, main, parse_rates,
                                       plot_online, plot_stall_timeline, read_record, request_row,
                                       run_online_benchmark, save_figure, stall_summary, stall_timeline,
                                       write_record)
from nanovllm_edu.bench.workload import make_workload
from nanovllm_edu.online import OnlineLLM

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENGINE_ARGS = {"device": "cpu", "num_kvcache_blocks": 256, "kvcache_block_size": 16, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def llm():
    engine = OnlineLLM(tiny_model_path(), **ENGINE_ARGS)
    yield engine
    engine.exit()


def test_arrivals_are_seeded_poisson():
    times = arrival_times(10_000, 20.0, seed=1)
    assert times == arrival_times(10_000, 20.0, seed=1) and times != arrival_times(10_000, 20.0, seed=2)
    assert times[0] == 0.0 and all(a <= b for a, b in pairwise(times))
    gaps = [b - a for a, b in pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)  # 5 standard errors at 10,000 gaps
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.05)  # exponential: the sd equals the mean
    slower = arrival_times(10_000, 10.0, seed=1)  # one seed, one pattern: only stretched
    assert all(s == pytest.approx(2 * t) for s, t in zip(slower, times))
    assert arrival_times(5, BURST) == [0.0] * 5 and arrival_times(0, 1.0) == []
    for bad in (0, -1.0, math.nan, "4"):
        with pytest.raises(ValueError, match="rate must be a positive number"):
            arrival_times(3, bad)


def test_latency_stats_on_known_data():
    stats = latency_stats([float(v) for v in range(100, 0, -1)])  # 1..100, given in any order
    assert stats == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert latency_stats([0.25]) == {"mean": 0.25, "p50": 0.25, "p90": 0.25, "p99": 0.25}
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_request_row_from_metrics():
    metrics = {"arrival_time": 10.0, "first_scheduled_time": 10.5, "first_token_time": 11.0,
               "last_token_time": 13.0, "finished_time": 13.25, "num_preemptions": 1}
    result = {"metrics": metrics, "token_ids": [1, 2, 3, 4, 5], "prompt_token_ids": [7] * 9, "finish_reason": "length"}
    row = request_row(result, start=9.0)
    assert row == {"arrival_s": 1.0, "finished_s": 4.25, "prompt_tokens": 9, "completion_tokens": 5,
                   "finish_reason": "length", "ttft_s": 1.0, "tpot_s": 0.5, "e2e_s": 3.25, "queue_s": 0.5,
                   "num_preemptions": 1}
    assert request_row(result | {"token_ids": [1]}, start=9.0)["tpot_s"] is None  # one token: no gap to time


def test_cpu_run_at_two_rates(llm, tmp_path):
    workload = make_workload(8, 48, 12, seed=3, min_input_len=8, min_output_len=2)
    record = run_online_benchmark(llm, workload, [10.0, 40.0], seed=5, timeout_s=60)
    assert record["device"] == "cpu" and record["versions"]["torch"] and record["date"]
    assert record["workload"]["num_seqs"] == 8 and record["engine_config"]["kvcache_block_size"] == 16
    for run, rate in zip(record["runs"], (10.0, 40.0)):
        assert run["request_rate"] == rate and not run["burst"]
        assert run["num_requests"] == run["num_completed"] == 8 and run["num_preemptions"] == 0
        assert run["output_tokens"] == workload.total_tokens and run["input_tokens"] == sum(workload.prompt_lens)
        assert run["output_throughput_tok_s"] == pytest.approx(run["output_tokens"] / run["duration_s"])
        for key in LATENCY_KEYS:
            stats = run[key]
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
        requests = run["requests"]
        planned = arrival_times(8, rate, seed=5)  # the driver submitted each request on time
        assert all(p - 1e-3 <= a <= p + 0.25 for p, a in zip(planned, requests["arrival_s"])), requests["arrival_s"]
        assert all(0 <= q <= t <= e for q, t, e in zip(requests["queue_s"], requests["ttft_s"], requests["e2e_s"]))
        assert run["duration_s"] >= requests["arrival_s"][-1] + requests["e2e_s"][-1] - 1e-5
    write_record(record, tmp_path / "online.json")
    assert read_record(tmp_path / "online.json") == record
    save_figure(plot_online(record), tmp_path / "online.png")
    assert (tmp_path / "online.png").read_bytes()[:8] == PNG_MAGIC


def test_stall_timeline_shows_the_prefill_gap(llm, tmp_path):
    timeline = stall_timeline(llm, num_running=3, long_prompt_len=1024, running_tokens=48, tokens_before=12)
    assert [len(times) for times in timeline["running"]] == [48] * 3
    band = timeline["long_prompt"]
    assert band["arrival_s"] <= band["first_scheduled_s"] < band["first_token_s"]
    summary = stall_summary(timeline)
    for start, end in summary["largest_gaps"]:  # every running request waits out the long prefill
        assert start < band["first_token_s"] and end > band["first_scheduled_s"], (start, end, band)
        assert end - start > 3 * summary["median_gap_s"]
    save_figure(plot_stall_timeline(timeline), tmp_path / "stall.png")
    assert (tmp_path / "stall.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_writes_record_and_plots(tmp_path, capsys):
    argv = ["--model", tiny_model_path(), "--device", "cpu", "--num-requests", "6", "--max-input-len", "32",
            "--max-output-len", "8", "--rates", "20,inf", "--num-kvcache-blocks", "128", "--kvcache-block-size", "16",
            "--stall-prompt-len", "256", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
            "--stall-plot", str(tmp_path / "s.png")]
    record = main(argv)
    assert [run["burst"] for run in record["runs"]] == [False, True]
    assert read_record(tmp_path / "r.json") == record and record["model"] == tiny_model_path()
    assert all((tmp_path / name).read_bytes()[:8] == PNG_MAGIC for name in ("r.png", "s.png"))
    out = capsys.readouterr().out
    assert "burst" in out and "TTFT p50/p99 ms" in out and "Stall: a 256-token prompt" in out


def test_cli_rates():
    assert parse_rates("1, 4.5,inf,burst") == [1.0, 4.5, BURST, BURST]
    for bad in ("0", "-2", "x", "nan"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--rates", bad])
        assert exit_info.value.code == 2
