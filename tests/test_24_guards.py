"""Lesson 24's guards: the body cap (413 by Content-Length before reading, and while reading a chunked body),
deep or malformed JSON (400), API keys on /v1 (401) with the other routes open, CORS preflights and headers,
/version, the event loop answering /health while a body is parsed or tokenized (checked with events, not
timings), and the server's deployment flags (positional MODEL, JSON lists, --chat-template, --seed)."""
import asyncio
import json
import os
import select
import subprocess
import sys
import threading
from importlib.metadata import version

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from nanovllm_edu.assets import tiny_model_path  # noqa: E402
from nanovllm_edu.online import OnlineLLM  # noqa: E402
from nanovllm_edu.serve import app as app_module  # noqa: E402
from nanovllm_edu.serve.__main__ import chat_template, parse_args, serve_options  # noqa: E402
from nanovllm_edu.serve.app import ServerThread, add_error_handlers, build_app, package_version  # noqa: E402
from nanovllm_edu.serve.guards import (  # noqa: E402
    MAX_JSON_DEPTH, MAX_REQUEST_BYTES, APIKeyMiddleware, ServeOptions, parse_json, read_body)
from nanovllm_edu.serve.protocol import APIError  # noqa: E402

MODEL = "tiny-test"
KEY = {"Authorization": "Bearer sk-test"}
BODY = {"model": MODEL, "prompt": "Return the", "max_tokens": 3, "temperature": 0}
PREFLIGHT = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def engine():
    llm = OnlineLLM(tiny_model_path(), device="cpu", num_kvcache_blocks=64, kvcache_block_size=16)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def keyed(engine):
    return TestClient(build_app(engine, MODEL, ServeOptions(api_key="sk-test", max_request_bytes=4096)))


# the body cap

def read_with(chunks: list[bytes], headers: dict, limit: int) -> tuple[object, int]:
    """read_body on a request whose body arrives as `chunks`: what it returned (or the APIError it raised) and
    how many chunks it took from the connection."""
    taken = []

    async def receive() -> dict:
        taken.append(1)
        i = len(taken) - 1
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(k.lower().encode(), v.encode())
                                                                         for k, v in headers.items()]}
    try:
        result = asyncio.run(read_body(Request(scope, receive), limit))
    except APIError as error:
        result = error
    return result, len(taken)


def test_a_body_over_the_cap_by_content_length_is_refused_before_a_byte_is_read():
    result, taken = read_with([b"x" * 17], {"Content-Length": "17"}, limit=16)
    assert isinstance(result, APIError) and result.status == 413 and taken == 0
    assert "16 bytes" in result.message and "--max-request-bytes" in result.message
    assert read_with([b"x" * 16], {"Content-Length": "16"}, limit=16) == (b"x" * 16, 1)


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap():
    result, taken = read_with([b"x" * 10] * 100, {"Transfer-Encoding": "chunked"}, limit=25)
    assert isinstance(result, APIError) and result.status == 413 and taken == 3  # 30 bytes > 25: stop there
    assert read_with([b"x" * 10] * 2, {}, limit=25) == (b"x" * 20, 2)


def test_the_default_cap_takes_long_contexts_and_refuses_20_mb():
    assert len(json.dumps({"prompt": [151_935] * 131_072})) < MAX_REQUEST_BYTES < 20_000_000


def test_the_app_answers_413_by_length_and_chunked(keyed):
    for content in (b" " * 4097, iter([b" " * 4000, b" " * 97])):
        reply = keyed.post("/v1/completions", content=content, headers=KEY)
        assert reply.status_code == 413 and reply.json()["error"]["type"] == "invalid_request_error"
    assert keyed.post("/v1/completions", content=json.dumps(BODY).encode(), headers=KEY).status_code == 200


# JSON

@pytest.mark.parametrize("raw, kind", [(b"[" * 200_000 + b"]" * 200_000, "too_deep"),
                                       (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "too_deep"),
                                       (b'{"prompt": "Ret', "not_json"), (b'{"prompt": "\xff"}', "not_json")])
def test_deep_or_malformed_json_is_a_400_naming_the_problem(raw, kind):
    with pytest.raises(APIError) as caught:
        parse_json(raw)
    assert caught.value.status == 400
    assert ("deeper than" in caught.value.message) == (kind == "too_deep")
    assert ("not valid JSON" in caught.value.message) == (kind == "not_json")


def test_json_within_the_depth_parses_brackets_in_strings_too():
    nested = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert parse_json(nested) is not None
    assert parse_json(json.dumps({"prompt": "[" * 500}).encode()) == {"prompt": "[" * 500}


def test_the_app_answers_400_for_deep_json(keyed):
    reply = keyed.post("/v1/completions", content=b"[" * 1000 + b"]" * 1000, headers=KEY)
    assert reply.status_code == 400 and "deeper than" in reply.json()["error"]["message"]


# keys

def test_v1_routes_need_the_key(keyed):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-test"},
                    {"Authorization": "sk-test"}):
        for reply in (keyed.get("/v1/models", headers=headers),
                      keyed.post("/v1/completions", json=BODY, headers=headers)):
            assert reply.status_code == 401, headers
            assert reply.json()["error"]["code"] == "invalid_api_key"
            assert reply.headers["www-authenticate"] == "Bearer"
    assert keyed.get("/v1/models", headers=KEY).status_code == 200
    assert keyed.get("/v1/models", headers={"Authorization": "bearer sk-test"}).status_code == 200


def test_routes_outside_v1_stay_open(keyed):
    assert keyed.get("/health").status_code == 200
    assert keyed.get("/version").json() == {"version": version("nanovllm-edu")}
    assert keyed.post("/tokenize", json={"prompt": "Return the"}).json()["count"] > 0
    assert keyed.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200


def test_no_key_set_means_open(engine):
    assert TestClient(build_app(engine, MODEL)).get("/v1/models").status_code == 200


def test_the_key_check_runs_before_the_body_is_read():
    taken = []

    async def app(scope, receive, send):
        taken.append(scope["path"])

    guarded = APIKeyMiddleware(app, api_key="sk-test")
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    sent = []

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    asyncio.run(guarded(scope, receive, send))
    assert taken == [] and sent[0]["status"] == 401
    asyncio.run(guarded(scope | {"method": "OPTIONS"}, receive, send))
    asyncio.run(guarded(scope | {"path": "/health"}, receive, send))
    assert taken == ["/v1/completions", "/health"]


# CORS

def test_a_preflight_is_answered_without_a_key(keyed, engine):
    reply = keyed.options("/v1/completions", headers=PREFLIGHT)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "*"
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert "access-control-allow-credentials" not in reply.headers
    refused = keyed.get("/v1/models", headers={"Origin": "https://chat.example"})  # a 401 a page can read
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert keyed.get("/health", headers={"Origin": "https://chat.example"}).headers[
        "access-control-allow-origin"] == "*"


def test_allowed_origins_and_credentials(engine):
    only = TestClient(build_app(engine, MODEL, ServeOptions(allowed_origins=["https://chat.example"])))
    assert only.options("/v1/completions", headers=PREFLIGHT).status_code == 200
    other = only.options("/v1/completions", headers=PREFLIGHT | {"Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    narrow = TestClient(build_app(engine, MODEL, ServeOptions(allowed_methods=["GET"])))
    assert narrow.options("/v1/completions", headers=PREFLIGHT).status_code == 400
    with_credentials = TestClient(build_app(engine, MODEL, ServeOptions(allow_credentials=True)))
    reply = with_credentials.options("/v1/completions", headers=PREFLIGHT)
    assert reply.headers["access-control-allow-credentials"] == "true"
    assert reply.headers["access-control-allow-origin"] == "https://chat.example"  # never "*" with credentials


# the event loop keeps its turns

@pytest.mark.parametrize("name", ["parse_json", "submit"])
def test_health_answers_while_a_body_is_parsed_or_tokenized(monkeypatch, name):
    """`name` is made to wait until /health has answered: on the event loop it would hold the loop, /health
    could not answer, and the wait would run out (seen: False)."""
    original, working, health_answered, seen = getattr(app_module, name), threading.Event(), threading.Event(), {}

    def waiting(*args, **kwargs):
        working.set()
        seen["health first"] = health_answered.wait(timeout=10)
        return original(*args, **kwargs)

    monkeypatch.setattr(app_module, name, waiting)
    engine = OnlineLLM(tiny_model_path(), device="cpu", num_kvcache_blocks=32, kvcache_block_size=16)
    server = ServerThread(engine, MODEL)  # its stop shuts this engine down: one of its own
    try:
        replies = []
        poster = threading.Thread(target=lambda: replies.append(httpx.post(server.url + "/v1/completions", json=BODY,
                                                                          timeout=30)))
        poster.start()
        assert working.wait(timeout=10)
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        health_answered.set()
        poster.join(30)
    finally:
        server.stop()
        engine.exit()
    assert seen["health first"] is True
    assert replies[0].status_code == 200


# flags

def test_positional_model_and_model_flag(capsys):
    assert parse_args(["/models/a"]).model == "/models/a"
    assert parse_args(["--model", "/models/a"]).model == "/models/a"
    assert parse_args(["/models/a", "--model", "/models/a"]).model == "/models/a"
    assert parse_args([]).model is None
    with pytest.raises(SystemExit) as stop:
        parse_args(["/models/a", "--model", "/models/b"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "'/models/a'" in err and "'/models/b'" in err and err.count("\n") == 1


def test_deployment_flags(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = parse_args([])
    assert serve_options(args) == ServeOptions()
    assert args.seed == 0
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    assert parse_args([]).api_key == "sk-env" and parse_args(["--api-key", "sk-flag"]).api_key == "sk-flag"
    options = serve_options(parse_args(["--allowed-origins", '["https://a.example"]', "--allowed-methods",
                                        '["GET", "POST"]', "--allowed-headers", "[]", "--allow-credentials",
                                        "--max-request-bytes", "1000"]))
    assert options == ServeOptions("sk-env", ["https://a.example"], ["GET", "POST"], [], True, 1000)
    for argv, flag in ([["--allowed-origins", "https://a.example"], "--allowed-origins"],
                       [["--allowed-headers", '{"a": 1}'], "--allowed-headers"],
                       [["--max-request-bytes", "0"], "--max-request-bytes"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert flag in err and err.count("\n") == 1, err


def test_chat_template_file_inline_or_unreadable(tmp_path, capsys):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert chat_template(str(path)) == template
    assert chat_template(template) == template
    assert parse_args(["--chat-template", str(path)]).chat_template == template
    with pytest.raises(SystemExit):
        parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
    assert "--chat-template" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a folder is no file
        parse_args(["--chat-template", str(tmp_path)])


def serve_and_ask(*flags: str) -> list:
    """Start the command line with `flags`; return what /tokenize makes of a chat, and two unseeded
    completions sampled one after the other."""
    command = [sys.executable, "-m", "nanovllm_edu.serve", "--port", "0", "--device", "cpu", "--log-level",
               "warning", "--num-kvcache-blocks", "64", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        assert select.select([process.stdout], [], [], 120)[0], "the server did not start"
        url = process.stdout.readline().split()[-1]
        chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}]}
        ids = httpx.post(url + "/tokenize", json=chat, timeout=30).json()["tokens"]
        text = httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        body = {"prompt": "Return the", "max_tokens": 16, "temperature": 1.5}
        samples = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                   for _ in range(2)]
        return [text, *samples]
    finally:
        process.terminate()
        process.wait(30)


def test_seed_repeats_unseeded_sampling_and_chat_template_renders_chats():
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    first = serve_and_ask("--seed", "7", "--chat-template", template)
    again = serve_and_ask("--seed", "7")
    assert first[0] == "<Hi><there>" and again[0] != first[0]  # the template replaced the tokenizer's
    assert first[1:] == again[1:]  # the same seed: the same draws, run after run
    assert first[1] != first[2]  # and they are draws: two requests in one run differ


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
