"""The OpenAI-compatible server (issue 15, item 4), talked to with the official `openai` client on 127.0.0.1:
completions and chat, plain and streamed (the chunks add up to the plain text), greedy parity with the engine,
400/404 error bodies, 24 concurrent streams, clients that hang up (their blocks come back), and the command
line: readiness, a taken port, SIGTERM."""
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanovllm_edu import SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.online import OnlineLLM
from nanovllm_edu.serve.app import ServerThread

MODEL = "tiny-test"
PROMPT = "Return the"
MESSAGES = [{"role": "user", "content": "Write a function that"}]
EXTRA = {"ignore_eos": True}  # fixed lengths: every request runs to max_tokens


@pytest.fixture(scope="module")
def served():
    """One engine and one server for the module; the engine is ours, so tests can look at its blocks."""
    llm = OnlineLLM(tiny_model_path(), device="cpu", num_kvcache_blocks=256, kvcache_block_size=16,
                    max_num_seqs=32)
    server = ServerThread(llm, MODEL)
    yield llm, server
    server.stop()
    llm.exit()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_all_blocks_free(llm: OnlineLLM, timeout: float = 10.0) -> None:
    """Poll until every KV block is free again (prefix-cached blocks that no request holds count as free: the
    block manager keeps them in its free list until it hands them out again)."""
    bm, deadline = llm.block_manager, time.monotonic() + timeout
    while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still held"


def test_health_and_models(served, client):
    assert httpx.get(served[1].url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("Qwen/Qwen3-0.6B")


def test_completion_equals_the_engine_and_counts_usage(served, client):
    llm = served[0]
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body=EXTRA)
    [ref] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-") and reply.model == MODEL
    assert reply.choices[0].text == ref["text"] and reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ref["prompt_token_ids"]), 12)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    ids = llm.tokenizer.encode(PROMPT)  # a prompt of token ids is the same request
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body=EXTRA)
    assert by_ids.choices[0].text == ref["text"]


def test_chat_equals_llm_chat(served, client):
    llm = served[0]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body=EXTRA)
    [ref] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == ref["text"]
    assert reply.usage.prompt_tokens == len(ref["prompt_token_ids"]) and reply.usage.completion_tokens == 10


def test_streamed_completion_adds_up_to_the_plain_one(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=EXTRA)
    plain = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 16  # the usage chunk comes last
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_starts_with_the_role_and_adds_up(client):
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=EXTRA)
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_completions_plain_and_streamed(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2, extra_body=EXTRA)
    plain = client.completions.create(**args)
    assert [c.index for c in plain.choices] == [0, 1] and plain.usage.completion_tokens == 16
    texts = ["", ""]
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in plain.choices]  # seeded: the same completions, streamed by index


def test_stop_strings_cut_plain_and_streamed_text(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=EXTRA)
    full = client.completions.create(**args).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full  # a stop string from the middle of the greedy completion
    cut = client.completions.create(**args, stop=[stop, "never seen"]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_in_both_formats(served, client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                      extra_body=EXTRA)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == 5
    for top, logprob in zip(lp.top_logprobs, lp.token_logprobs):  # greedy: the sampled token is the top one
        assert len(top) >= 2 and max(top.values()) == logprob
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body=EXTRA)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == t.logprob and bytes(t.bytes).decode() == t.token for t in content)


BAD_REQUESTS = [  # (path, raw body, the param the error names)
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "a",', None),
    ("/v1/completions", b'["not", "an", "object"]', None),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "16"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "a", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "max_token": 5}, "max_token"),
    ("/v1/completions", {"prompt": "a", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    # what vLLM refuses and this server once let pass
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": True, "usage": 1}},
     "stream_options.usage"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function",
                                                                     "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "assistant", "content": "def"}],
                              "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True,
                              "add_generation_prompt": False}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": False},
     "messages"),
    ("/v1/completions", {"prompt": "a", "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 20, "max_tokens": 8}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "skip_special_tokens": 0}, "skip_special_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_get_400_with_openai_error_body(served, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL} | body).encode()
    reply = httpx.post(served[1].url + path, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"], error


def test_client_errors_and_unknown_model(served, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-5", messages=MESSAGES)
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    reply = httpx.get(served[1].url + "/v1/nowhere")
    assert reply.status_code == 404 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    wait_all_blocks_free(served[0])  # refused requests hold nothing


def test_24_concurrent_streams_are_served_in_full(served):
    llm, server = served
    prompts = [f"{PROMPT} {word}" for word in "abcdefghijklmnopqrstuvwx"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = [out["text"] for out in llm.generate(prompts, params, use_tqdm=False)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, extra_body=EXTRA)
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    async def all_of_them() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == [(ref, "length") for ref in refs]
    wait_all_blocks_free(llm)


def test_a_client_that_hangs_up_mid_stream_frees_its_blocks(served, caplog):
    llm, server = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "stream": True, **EXTRA}
    with caplog.at_level(logging.INFO, logger="nanovllm_edu.serve"):
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as reply:
            events = reply.iter_lines()
            first = [next(line for line in events if line.startswith("data: ")) for _ in range(3)]
            assert llm.block_manager.num_free_blocks < llm.block_manager.num_blocks  # it holds blocks
        wait_all_blocks_free(llm)  # the connection is closed: 1500 tokens would take far longer
    assert json.loads(first[0][6:])["object"] == "text_completion"
    assert any("dropped: the client hung up" in r.getMessage() for r in caplog.records)


def test_a_client_that_hangs_up_before_a_plain_reply_frees_its_blocks(served, caplog):
    llm, server = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, **EXTRA}
    with caplog.at_level(logging.INFO, logger="nanovllm_edu.serve"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        wait_all_blocks_free(llm)
    assert any("finish_reason abort" in r.getMessage() for r in caplog.records)


def read_line_within(stream, seconds: float) -> str:
    """The next line of a subprocess's output, or "" after `seconds` (read in a thread: pipes have no
    timeout)."""
    line = []
    reader = threading.Thread(target=lambda: line.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return line[0] if line else ""


def start_cli(*args: str) -> subprocess.Popen:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "nanovllm_edu.serve", "--device", "cpu", "--log-level", "warning", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_command_line_serves_refuses_a_taken_port_and_stops_on_sigterm(served):
    taken = served[1].url.rsplit(":", 1)[1]
    with socket.socket() as probe:  # a free port for the real server
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    server = start_cli("--port", port, "--num-kvcache-blocks", "128", "--kvcache-block-size", "16")
    clash = start_cli("--port", taken)
    try:
        _, err = clash.communicate(timeout=60)
        assert clash.returncode != 0 and f"cannot listen on 127.0.0.1:{taken}" in err, err
        ready = read_line_within(server.stdout, 60)
        died = server.poll() is not None and server.stderr.read()
        assert ready.strip() == f"serving tiny-qwen3 on http://127.0.0.1:{port}", (ready, died)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": 1500, "stream": True, **EXTRA}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)  # mid-stream: the stream ends with "abort", the server exits
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert server.wait(timeout=10) == 0 and time.monotonic() - signalled < 5
    finally:
        for proc in (server, clash):
            if proc.poll() is None:
                proc.kill()


def test_openai_sdk_sends_a_batch_with_echo(served, client):
    """The SDK's legacy completions with a list of prompts, echo and logprobs: one choice per prompt, each
    starting with its prompt, the first token's logprob null."""
    reply = client.completions.create(model=MODEL, prompt=[PROMPT, "Create a"], max_tokens=3, temperature=0,
                                      echo=True, logprobs=1, extra_body=EXTRA)
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1]
    assert choices[0].text.startswith(PROMPT) and choices[1].text.startswith("Create a")
    assert all(c.logprobs.token_logprobs[0] is None and None not in c.logprobs.token_logprobs[1:] for c in choices)
    assert reply.usage.completion_tokens == 6


def test_continuous_usage_stats_count_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries its prompt's tokens and
    its choice's tokens so far; the last chunk, with no choices, the totals."""
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2, stream=True, extra_body=EXTRA,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    *choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12 and last.usage.prompt_tokens == 2
    sent = {0: 0, 1: 0}
    for chunk in choices:
        assert chunk.usage is not None and chunk.usage.prompt_tokens == 2
        index = chunk.choices[0].index
        assert chunk.usage.completion_tokens >= sent[index]  # counts only grow, per choice
        sent[index] = chunk.usage.completion_tokens
        assert chunk.usage.total_tokens == 2 + sent[index]
    assert sent == {0: 6, 1: 6}
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_chat_continues_the_final_message_and_skips_the_generation_prompt(served, client):
    """continue_final_message leaves the assistant's last message open (its text is continued, with no end-of-turn
    token after it); add_generation_prompt=false renders no assistant opening: both on /tokenize and on the chat
    route, whose reply equals the engine's greedy completion of the same ids."""
    llm, server = served
    partial = MESSAGES + [{"role": "assistant", "content": "def add"}]
    body = {"model": MODEL, "messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    text = llm.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\ndef add"), text
    reply = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=5, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    [expected] = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert reply.choices[0].message.content == expected["text"]
    no_opening = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES,
                                                            "add_generation_prompt": False}).json()["tokens"]
    assert not llm.tokenizer.decode(no_opening).endswith("<|im_start|>assistant\n")
    assert httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["count"] > len(
        no_opening)


def test_an_error_in_reading_a_stream_ends_the_request_instead_of_hanging():
    """A stream whose outputs cannot be read (here the tokenizer's decode raises) ends the request: `outputs_of`
    raises the error, and a streamed reply says so in an error event, then [DONE]. Before, only a RuntimeError
    was handed on, and any other error left the request waiting forever."""
    from types import SimpleNamespace

    from nanovllm_edu.engine.sequence import Sequence
    from nanovllm_edu.online import RequestOutput, RequestStream
    from nanovllm_edu.serve.app import outputs_of, stream_events
    from nanovllm_edu.serve.protocol import OpenAIRequest

    class BrokenTokenizer:
        def decode(self, ids, **decode_args):
            raise TypeError("decode() got an unexpected keyword argument")

    def stream() -> RequestStream:
        seq = Sequence([1, 2], SamplingParams(max_tokens=2))
        s = RequestStream(SimpleNamespace(tokenizer=BrokenTokenizer(), abort=lambda stream: None), "r-0", seq)
        s.put(RequestOutput("r-0", 0, [3], None, 0.0, None, None))
        return s

    async def outputs() -> list:
        return [out async for out in outputs_of([stream()])]
    with pytest.raises(TypeError, match="unexpected keyword"):
        asyncio.run(asyncio.wait_for(outputs(), 10))

    request = OpenAIRequest("completion", MODEL, {"max_tokens": 2}, stream=True, prompt=["x"], id="cmpl-0",
                            created=0)

    async def events() -> list[str]:
        return [event async for event in stream_events(request, [stream()], BrokenTokenizer())]
    got = asyncio.run(asyncio.wait_for(events(), 10))
    assert got[-1].strip() == "data: [DONE]"
    error = json.loads(got[-2].strip().removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "unexpected keyword" in error["message"]
