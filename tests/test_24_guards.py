"""Lesson 24's guards (issue 43): the body cap (413 by Content-Length and while a chunked body is read), JSON
parsed off the event loop and refused by name when malformed or nested too deep, vLLM's API key on /v1 (401, the
other routes open, preflights let through), CORS as vLLM's flags set it, /version, /metrics mounted once, and the
command line's vLLM flags (a positional MODEL, --chat-template from a file or inline, --seed, CORS lists)."""
import asyncio
import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient

from nanovllm_edu import SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.online import OnlineLLM
from nanovllm_edu.serve import __main__ as cli
from nanovllm_edu.serve import app as app_module
from nanovllm_edu.serve.app import build_app, package_version
from nanovllm_edu.serve.guards import MAX_JSON_DEPTH, MAX_REQUEST_BYTES, ServeOptions, parse_json
from nanovllm_edu.serve.protocol import APIError

MODEL = "tiny-test"
BODY = {"model": MODEL, "prompt": "Return the", "max_tokens": 3, "temperature": 0}
KEY = {"Authorization": "Bearer sk-test"}
PREFLIGHT = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def engine():
    llm = OnlineLLM(tiny_model_path(), device="cpu", num_kvcache_blocks=64, kvcache_block_size=16, max_num_seqs=4)
    yield llm
    llm.exit()


def error_of(reply) -> dict:
    return reply.json()["error"]


def test_a_body_over_the_cap_is_413_by_its_length_and_while_chunked(engine):
    http = TestClient(build_app(engine, MODEL, ServeOptions(max_request_bytes=1000)))
    big = json.dumps(BODY | {"prompt": "x" * 2000}).encode()
    reply = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert reply.status_code == 413 and "1000 bytes" in error_of(reply)["message"]
    assert "--max-request-bytes" in error_of(reply)["message"]
    def chunks():  # no Content-Length: the server must count while it reads
        for _ in range(50):
            yield b" " * 100

    reply = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert http.post("/v1/completions", json=BODY).status_code == 200  # within the cap: served
    assert MAX_REQUEST_BYTES == 10 * 2**20 and MAX_REQUEST_BYTES < 20_000_000  # the 20 MB is refused


@pytest.mark.parametrize("raw, words", [(b'{"prompt": "a",', "not valid JSON"),
                                        (b"\xff\xfe", "not valid JSON"),
                                        (b"[" * 200_000 + b"]" * 200_000, "deeper than"),
                                        (b'{"p": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
                                         "deeper than")])
def test_malformed_and_deep_json_are_400s_that_name_the_problem(engine, raw, words):
    reply = TestClient(build_app(engine, MODEL)).post("/v1/completions", content=raw)
    assert reply.status_code == 400 and words in error_of(reply)["message"], reply.text


def test_json_within_the_depth_parses():
    nested = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert isinstance(parse_json(nested)["a"], list)
    with pytest.raises(APIError):
        parse_json(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))


def test_the_event_loop_answers_health_while_a_body_is_parsed(engine, monkeypatch):
    """parse_json is made to wait until /health has been answered: on the event loop it could never be (the wait
    runs out and the request gets a 500); in a worker thread /health answers meanwhile."""
    parsing, health_answered = threading.Event(), threading.Event()
    real = app_module.parse_json

    def waits_for_health(raw):
        parsing.set()
        assert health_answered.wait(10), "/health was not answered while the body was parsed"
        return real(raw)

    monkeypatch.setattr(app_module, "parse_json", waits_for_health)
    with TestClient(build_app(engine, MODEL)) as http:  # one event loop for every request, as uvicorn has
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault("reply", http.post("/v1/completions", json=BODY)))
        worker.start()
        assert parsing.wait(10)
        assert http.get("/health").status_code == 200
        health_answered.set()
        worker.join(30)
    assert result["reply"].status_code == 200, result["reply"].text


def test_the_key_guards_v1_and_leaves_the_other_routes_open(engine):
    http = TestClient(build_app(engine, MODEL, ServeOptions(api_key="sk-test")))
    for reply in (http.post("/v1/completions", json=BODY), http.get("/v1/models"),
                  http.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sk-wrong"}),
                  http.post("/v1/completions", json=BODY, headers={"Authorization": "sk-test"})):
        assert reply.status_code == 401 and error_of(reply)["code"] == "invalid_api_key", reply.text
        assert reply.headers["www-authenticate"] == "Bearer"
    assert http.post("/v1/completions", json=BODY, headers=KEY).status_code == 200
    assert http.get("/v1/models", headers=KEY).status_code == 200
    for path in ("/health", "/version", "/metrics"):
        assert http.get(path).status_code == 200, path
    assert http.post("/tokenize", json={"model": MODEL, "prompt": "Return the"}).status_code == 200
    assert http.post("/detokenize", json={"model": MODEL, "tokens": [374]}).status_code == 200
    preflight = http.options("/v1/completions", headers=PREFLIGHT)  # browsers send no Authorization on it
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*",
                                                                                               "https://chat.example")


def test_no_key_means_every_route_is_open(engine):
    assert TestClient(build_app(engine, MODEL)).post("/v1/completions", json=BODY).status_code == 200


def test_cors_follows_vllms_flags(engine):
    open_app = TestClient(build_app(engine, MODEL))
    reply = open_app.options("/v1/completions", headers=PREFLIGHT)
    assert reply.status_code == 200, reply.text  # lesson 23's server answered 405
    assert "access-control-allow-credentials" not in reply.headers  # off by default
    strict = TestClient(build_app(engine, MODEL, ServeOptions(
        allowed_origins=["https://chat.example"], allowed_methods=["POST"], allowed_headers=["content-type"],
        allow_credentials=True)))
    ok = strict.options("/v1/completions", headers=PREFLIGHT | {"Access-Control-Request-Headers": "content-type"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://chat.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    other = strict.options("/v1/completions", headers=PREFLIGHT | {"Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = strict.post("/v1/completions", json=BODY, headers={"Origin": "https://chat.example"})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "https://chat.example"


def test_version_and_metrics_are_mounted_once(engine):
    app = build_app(engine, MODEL)
    http = TestClient(app)
    assert http.get("/version").json() == {"version": package_version()} and package_version() != ""
    assert [r.path for r in app.routes].count("/metrics") == 1
    before = engine.observer
    http.post("/v1/completions", json=BODY)
    text = http.get("/metrics").text
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 1.0' in text
    assert engine.observer is before


def test_the_command_line_takes_vllms_flags(tmp_path, monkeypatch):
    model = tiny_model_path()
    assert cli.parse_args([model]).model == model  # vllm serve MODEL
    assert cli.parse_args(["--model", model]).model == model
    with pytest.raises(SystemExit):
        cli.parse_args([model, "--model", str(tmp_path)])
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert cli.parse_args(["--chat-template", str(template)]).chat_template == template.read_text()
    inline = "{{ messages[0].content }}"
    assert cli.parse_args(["--chat-template", inline]).chat_template == inline
    with pytest.raises(SystemExit):
        cli.parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    args = cli.parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials", "--api-key", "k"])
    options = cli.serve_options(args)
    assert options.allowed_origins == ["https://a.example"] and options.allow_credentials and options.api_key == "k"
    with pytest.raises(SystemExit):
        cli.parse_args(["--allowed-origins", "https://a.example"])  # not a JSON list
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert cli.parse_args([]).api_key == "from-env"
    assert cli.parse_args([]).seed == 0


def test_the_seed_makes_unseeded_sampling_repeat(engine):
    def draw(seed: int) -> list[int]:
        cli.seed_sampling(seed)
        [out] = engine.generate(["Return the"], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
        return out["token_ids"]

    first, again, other = draw(5), draw(5), draw(6)
    assert first == again
    assert first != other  # 12 tokens at T=1 over 2 seeds: equal only by a chance far below 1e-6
