"""Prometheus metrics under vLLM's names (serve/metrics.py, exported from notebooks/24_deployment.ipynb): every
series vLLM's Grafana dashboards read is in a scrape with model_name; the counters move with traffic by the
right amounts (async scheduling's placeholders and void rows counted never or once); the gauges are read at the
scrape; two engines keep separate registries; attaching keeps async scheduling and times nothing."""
import time
from contextlib import nullcontext

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from nanovllm_edu import SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.online import OnlineLLM
from nanovllm_edu.serve.app import build_app
from nanovllm_edu.serve.metrics import TTFT_BUCKETS, EngineMetrics, buckets_1_2_5

MODEL = "tiny-metrics"

# Every `vllm:` series read by an "expr" of vLLM's published Grafana dashboards (vllm-project/vllm):
#   examples/online_serving/prometheus_grafana/grafana.json, commit e88892c9080b29aa3dbc1d1096ba719ab0886163 (older)
#   examples/observability/prometheus_grafana/grafana.json, commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9 (newer)
BOTH_DASHBOARDS = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
]
OLDER_ONLY = [
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_swapped", "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc",
]
NEWER_ONLY = [
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:kv_cache_usage_perc",
]
DASHBOARD_SERIES = BOTH_DASHBOARDS + OLDER_ONLY + NEWER_ONLY
# vLLM serves these too, and the lesson says what each is
MORE_SERIES = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
               "vllm:request_inference_time_seconds_sum", "vllm:request_time_per_output_token_seconds_count",
               "vllm:request_params_n_count", "vllm:request_params_max_tokens_count"]


def make_engine(**kw) -> OnlineLLM:
    args = {"device": "cpu", "num_kvcache_blocks": 64, "kvcache_block_size": 16, "max_num_seqs": 4} | kw
    return OnlineLLM(tiny_model_path(), **args)


def scrape(http: TestClient) -> list:
    reply = http.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return [s for family in text_string_to_metric_families(reply.text) for s in family.samples]


def values(http: TestClient) -> dict:
    """(sample name, finished_reason) -> value for this model; buckets and creation times left out."""
    return {(s.name, s.labels.get("finished_reason", "")): s.value for s in scrape(http)
            if s.labels.get("model_name") == MODEL and "le" not in s.labels and not s.name.endswith("_created")}


@pytest.fixture(scope="module")
def served():
    engine = make_engine()
    app = build_app(engine, MODEL)
    metrics = app.state.metrics  # build_app mounts them
    yield engine, metrics, TestClient(app)
    engine.exit()


def test_every_series_the_dashboards_read_is_scraped_with_model_name(served):
    _, _, http = served
    samples = scrape(http)
    found = {s.name for s in samples if s.labels.get("model_name") == MODEL and s.labels.get("engine") == "0"}
    missing = [name for name in DASHBOARD_SERIES + MORE_SERIES if name not in found]
    assert not missing, f"series the dashboards read that a scrape lacks: {missing}"
    assert {s.labels["finished_reason"] for s in samples if s.name == "vllm:request_success_total"} \
        == {"stop", "length", "abort"}
    assert all(s.labels.get("model_name") == MODEL for s in samples), "every series carries model_name"


def test_buckets_are_vllms():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]  # vLLM's docstring example
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22


def test_counters_move_with_traffic_by_the_right_amounts(served):
    engine, _, http = served
    before = values(http)
    fixed = {"ignore_eos": True}  # these run to max_tokens
    bodies = [{"prompt": "Return the", "max_tokens": 5} | fixed, {"prompt": "Create a", "max_tokens": 7} | fixed,
              {"prompt": "List all", "max_tokens": 3, "n": 3} | fixed, {"prompt": [5, 6, 7, 8, 9], "max_tokens": 1},
              {"prompt": "Return the", "max_tokens": 12, "stop": ["\n"]}]
    replies = [http.post("/v1/completions", json={"temperature": 0} | body).json() for body in bodies]
    assert [[c["finish_reason"] for c in r["choices"]] for r in replies] == [["length"]] * 2 + [["length"] * 3] \
        + [["length"], ["stop"]]
    long_run = engine.submit("Return the", SamplingParams(max_tokens=400, ignore_eos=True))
    next(iter(long_run))
    long_run.abort()
    aborted = long_run.result(timeout=30)
    assert aborted["finish_reason"] == "abort"
    after = values(http)

    def moved(name, reason=""):
        return after[name, reason] - before[name, reason]

    n = [body.get("n", 1) for body in bodies]
    # each completion counts its prompt, as vLLM's n child requests do; the usage counts it once per request
    prompt_tokens = sum(r["usage"]["prompt_tokens"] * k for r, k in zip(replies, n)) + len(aborted["prompt_token_ids"])
    generated = sum(r["usage"]["completion_tokens"] for r in replies) + len(aborted["token_ids"])
    num_seqs = sum(n) + 1
    assert moved("vllm:prompt_tokens_total") == prompt_tokens == moved("vllm:request_prompt_tokens_sum")
    assert moved("vllm:generation_tokens_total") == generated == moved("vllm:request_generation_tokens_sum")
    assert {r: moved("vllm:request_success_total", r) for r in ("stop", "length", "abort")} \
        == {"stop": 1, "length": 6, "abort": 1}
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_generation_tokens",
                 "request_time_per_output_token_seconds", "request_params_max_tokens"):
        assert moved(f"vllm:{name}_count") == num_seqs, name
    assert moved("vllm:request_params_n_count") == len(bodies) + 1  # n: 3 is one request
    assert moved("vllm:request_params_n_sum") == sum(n) + 1
    longest = [5, 7, 3, 1, replies[4]["usage"]["completion_tokens"], len(aborted["token_ids"])]
    assert moved("vllm:request_max_num_generation_tokens_sum") == sum(longest)
    gaps = generated - num_seqs  # one inter-token gap per token after a sequence's first
    assert moved("vllm:inter_token_latency_seconds_count") == gaps == moved("vllm:time_per_output_token_seconds_count")
    assert moved("vllm:inter_token_latency_seconds_sum") > 0
    assert moved("vllm:prefix_cache_queries_total") == sum(r["usage"]["prompt_tokens"] for r in replies) \
        + len(aborted["prompt_token_ids"])  # n: 3's other completions reuse its lookup


def test_prefix_cache_hits_are_counted_in_tokens(served):
    _, _, http = served
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be served from the cache
    before = values(http)
    for _ in range(2):
        assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    after = values(http)
    assert after["vllm:prefix_cache_queries_total", ""] - before["vllm:prefix_cache_queries_total", ""] == 80
    assert after["vllm:prefix_cache_hits_total", ""] - before["vllm:prefix_cache_hits_total", ""] == 32


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_gauges_are_the_engines_state_at_the_scrape():
    engine = make_engine(max_num_seqs=1)
    app = build_app(engine, MODEL)
    http = TestClient(app)
    idle = values(http)
    assert idle["vllm:num_requests_running", ""] == idle["vllm:num_requests_waiting", ""] == 0
    assert idle["vllm:kv_cache_usage_perc", ""] == 0
    streams = [engine.submit("Return the", SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(2)]
    next(iter(streams[0]))
    wait_for(lambda: len(engine.scheduler.waiting) == 1)
    busy = values(http)
    assert busy["vllm:num_requests_running", ""] == 1 and busy["vllm:num_requests_waiting", ""] == 1
    used = len(engine.block_manager.used_block_ids) / engine.block_manager.num_blocks
    assert busy["vllm:kv_cache_usage_perc", ""] > 0 and abs(busy["vllm:kv_cache_usage_perc", ""] - used) < 0.2
    assert busy["vllm:gpu_cache_usage_perc", ""] == busy["vllm:kv_cache_usage_perc", ""]
    for stream in streams:
        stream.abort()
        stream.result(timeout=30)
    done = values(http)  # nothing stepped since: the gauges are read now, not at the last step
    assert done["vllm:num_requests_running", ""] == done["vllm:num_requests_waiting", ""] == 0
    assert done["vllm:kv_cache_usage_perc", ""] == 0
    assert done["vllm:request_success_total", "abort"] == 2
    engine.exit()


def test_two_engines_keep_separate_registries():
    first, second = make_engine(), make_engine()
    apps = [build_app(first, "first"), build_app(second, "second")]
    metrics = [app.state.metrics for app in apps]
    assert metrics[0].registry is not metrics[1].registry
    first.generate(["Return the"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    texts = [TestClient(app).get("/metrics").text for app in apps]
    assert 'vllm:generation_tokens_total{engine="0",model_name="first"} 4.0' in texts[0]
    assert 'vllm:generation_tokens_total{engine="0",model_name="second"} 0.0' in texts[1]
    assert 'model_name="second"' not in texts[0] and 'model_name="first"' not in texts[1]
    import prometheus_client
    assert prometheus_client.REGISTRY.get_sample_value("vllm:generation_tokens_total", {"engine": "0",
                                                       "model_name": "first"}) is None  # not the global one
    first.exit()
    second.exit()


def test_attaching_keeps_async_scheduling_and_times_nothing(served):
    engine, metrics, _ = served
    assert engine.observer is metrics and engine.config.async_scheduling
    assert metrics.one_step_at_a_time is False
    assert type(metrics).part is nullcontext  # the base's: the engine's parts run no observer code
    assert isinstance(metrics, EngineMetrics)
