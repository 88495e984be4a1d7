"""The server as evaluation harnesses drive it (notebook 23): lm-evaluation-harness's `local-completions`
request shapes, replayed against a live server, and every loglikelihood checked against transformers'
log_softmax on the same checkpoint (lm-eval itself is not a dependency: README, "Evaluating through the
server", runs it for real)."""
import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.online import OnlineLLM
from nanovllm_edu.serve.app import ServerThread

from parity import hf_greedy

MODEL = "tiny-qwen3"
# (context, continuations): multiple-choice questions as lm-eval's loglikelihood requests pair them
QUESTIONS = [("Raise ValueError if the", [" value is negative.", " cat is hungry."]),
             ("Return the", [" number of items in the list.", " moon."]),
             ("This module provides", [" functions for working with files.", " a red balloon."])]


@pytest.fixture(scope="module")
def served():
    llm = OnlineLLM(tiny_model_path(), device="cpu", num_kvcache_blocks=256, kvcache_block_size=16, max_num_seqs=16)
    server = ServerThread(llm, MODEL)
    yield llm, server
    server.stop()
    llm.exit()


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


def post(server, path: str, body: dict) -> dict:
    reply = httpx.post(server.url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, and the full rows they come from, by transformers in float32."""
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]
    return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1), rows


def requests_of(tokenizer) -> list[tuple[list[int], int]]:
    """Each (context + continuation ids, context length), as lm-eval tokenizes them."""
    pairs = []
    for context, options in QUESTIONS:
        context_ids = tokenizer.encode(context)
        pairs += [(context_ids + tokenizer.encode(option), len(context_ids)) for option in options]
    return pairs


def check_echo_choice(choice: dict, ids: list[int], hf, generated: int) -> None:
    """An echoed choice covers every prompt token (the first null) and `generated` more; each prompt token's
    logprob equals transformers' within 1e-4, its entry lists it, and the top-1 token is transformers' argmax."""
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:]) and all(lp["top_logprobs"][1:])
    reference, rows = hf_logprobs(hf, ids)
    served = torch.tensor(lp["token_logprobs"][1:len(ids)])
    assert (served - reference).abs().max().item() <= 1e-4
    for position, (token_text, top) in enumerate(zip(lp["tokens"][1:len(ids)], lp["top_logprobs"][1:len(ids)])):
        assert top[token_text] == lp["token_logprobs"][position + 1]  # the prompt's own token is listed
        assert max(top.values()) == pytest.approx(rows[position].max().item(), abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihood_requests_equal_transformers(served, hf, tokenizer, max_tokens):
    """lm-eval's loglikelihood batch: token-id prompts, echo, logprobs=1, temperature 0, seed; max_tokens 1
    (lm-eval's) and 0 (score only). lm-eval sums token_logprobs[ctxlen:-1] with max_tokens 1."""
    pairs = requests_of(tokenizer)
    body = {"model": MODEL, "prompt": [ids for ids, _ in pairs], "max_tokens": max_tokens, "logprobs": 1,
            "echo": True, "temperature": 0, "seed": 1234}
    reply = post(served[1], "/v1/completions", body)
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == list(range(len(pairs)))
    for choice, (ids, ctxlen) in zip(choices, pairs):
        check_echo_choice(choice, ids, hf, generated=max_tokens)
        assert choice["text"].startswith(tokenizer.decode(ids)) and choice["finish_reason"] in ("length", "stop")
        end = len(choice["logprobs"]["token_logprobs"]) - max_tokens  # lm-eval: [ctxlen:-1] with max_tokens 1
        continuation = sum(choice["logprobs"]["token_logprobs"][ctxlen:end])
        reference = hf_logprobs(hf, ids)[0][ctxlen - 1:].sum().item()
        assert abs(continuation - reference) <= 1e-4 * len(ids)
    assert reply["usage"]["prompt_tokens"] == sum(len(ids) for ids, _ in pairs)
    assert reply["usage"]["completion_tokens"] == max_tokens * len(pairs)


def test_multiple_choice_picks_the_answer_transformers_picks(served, hf, tokenizer):
    """Accuracy's ingredient: per question, the choice with the largest loglikelihood, served and by
    transformers, in batches of one and of several questions (lm-eval's --batch_size)."""
    pairs = requests_of(tokenizer)
    reference = [hf_logprobs(hf, ids)[0][ctxlen - 1:].sum().item() for ids, ctxlen in pairs]
    for batch in (1, 4):
        served_scores = []
        for start in range(0, len(pairs), batch):
            part = pairs[start:start + batch]
            reply = post(served[1], "/v1/completions", {"model": MODEL, "prompt": [ids for ids, _ in part],
                                                         "max_tokens": 1, "logprobs": 1, "echo": True,
                                                         "temperature": 0})
            for choice, (_, ctxlen) in zip(sorted(reply["choices"], key=lambda c: c["index"]), part):
                served_scores.append(sum(choice["logprobs"]["token_logprobs"][ctxlen:-1]))
        assert max(abs(a - b) for a, b in zip(served_scores, reference)) <= 1e-3
        picks, reference_picks, i = [], [], 0
        for _, options in QUESTIONS:
            scores, ref = served_scores[i:i + len(options)], reference[i:i + len(options)]
            picks.append(scores.index(max(scores)))
            reference_picks.append(ref.index(max(ref)))
            i += len(options)
        assert picks == reference_picks


def test_string_prompts_score_like_their_ids(served, tokenizer):
    """A batch of string prompts is tokenized by the server as by the harness: the same logprobs as ids."""
    pairs = requests_of(tokenizer)[:3]
    texts = [tokenizer.decode(ids) for ids, _ in pairs]
    assert [tokenizer.encode(t) for t in texts] == [ids for ids, _ in pairs]
    common = {"model": MODEL, "max_tokens": 0, "logprobs": 1, "echo": True}
    by_text = post(served[1], "/v1/completions", common | {"prompt": texts})["choices"]
    by_ids = post(served[1], "/v1/completions", common | {"prompt": [ids for ids, _ in pairs]})["choices"]
    for a, b in zip(by_text, by_ids):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"][1:], b["logprobs"]["token_logprobs"][1:])) <= 1e-5


def test_echo_streamed_equals_echo_whole(served, tokenizer):
    """Streamed with echo (as vLLM streams it): the chunks of each choice add up to the whole reply's text and
    logprobs; with n = 2 and two prompts, choices are numbered prompt index * n + completion index."""
    body = {"model": MODEL, "prompt": ["Return the", "Create a"], "max_tokens": 4, "logprobs": 2, "echo": True,
            "temperature": 0, "n": 2}
    whole = post(served[1], "/v1/completions", body)
    assert sorted(c["index"] for c in whole["choices"]) == [0, 1, 2, 3]
    texts, logprobs = {}, {}
    with httpx.stream("POST", served[1].url + "/v1/completions", json=body | {"stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                part = choice["logprobs"] or {}
                for key, values in part.items():
                    logprobs.setdefault(choice["index"], {}).setdefault(key, []).extend(values)
    for choice in whole["choices"]:
        assert texts[choice["index"]] == choice["text"]
        assert logprobs[choice["index"]]["tokens"] == choice["logprobs"]["tokens"]
        assert logprobs[choice["index"]]["text_offset"] == choice["logprobs"]["text_offset"]
        assert logprobs[choice["index"]]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    assert whole["choices"][0]["text"].startswith("Return the") and whole["choices"][2]["text"].startswith("Create a")


def test_generate_until_requests_equal_greedy_transformers(served, tokenizer):
    """lm-eval's generate_until: a batch of prompts, a stop list, a seed, temperature 0; each text is
    transformers' greedy continuation cut before the first stop string."""
    prompts = ["Return the", "This module provides"]
    stops = ["\n\n", "."]
    reply = post(served[1], "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 24,
                                                 "temperature": 0, "stop": stops, "seed": 1234})
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    reference = hf_greedy(tiny_model_path(), [tokenizer.encode(p) for p in prompts], 24)
    for choice, ids in zip(choices, reference):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((text.index(s) for s in stops if s in text), default=len(text))
        assert choice["text"] == text[:cut]


def test_prompt_logprobs_in_vllm_shape(served, hf, tokenizer):
    """vLLM's prompt_logprobs field, on both endpoints: null, then token id -> logprob, rank, decoded_token;
    the prompt token's rank is its rank in transformers' distribution."""
    ids = tokenizer.encode("Return the value of the")
    reply = post(served[1], "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    entries = reply["choices"][0]["prompt_logprobs"]
    reference, rows = hf_logprobs(hf, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for position in range(1, len(ids)):
        entry, row = entries[position], rows[position - 1]
        token = ids[position]
        assert set(entry) == {str(t) for t in row.topk(2).indices.tolist()} | {str(token)}
        assert entry[str(token)]["rank"] == 1 + (row > row[token]).sum().item()
        assert abs(entry[str(token)]["logprob"] - reference[position - 1].item()) <= 1e-4
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert min(e["rank"] for e in entry.values()) == 1
    chat = post(served[1], "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "prompt_logprobs": 0,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_tokenize_detokenize_and_model_retrieve(served, tokenizer):
    server = served[1]
    counted = post(server, "/tokenize", {"model": MODEL, "prompt": "Return the value"})
    assert counted["tokens"] == tokenizer.encode("Return the value") and counted["count"] == len(counted["tokens"])
    assert counted["max_model_len"] == served[0].config.max_model_len
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["tokens"] == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True,
                                                            add_generation_prompt=True, return_dict=False)
    assert post(server, "/detokenize", {"tokens": counted["tokens"]})["prompt"] == "Return the value"
    assert httpx.get(server.url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = httpx.get(server.url + "/v1/models/Qwen/Qwen3-0.6B")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


BAD = [  # (path, body, the param the 400 names)
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1, 2]]}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_batches_get_400_and_the_server_serves_on(served, path, body, param):
    reply = httpx.post(served[1].url + path, json={"model": MODEL} | body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    bm = served[0].block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing of a refused batch was queued
    assert post(served[1], "/v1/completions", {"model": MODEL, "prompt": "Return the", "max_tokens": 2})["choices"]


def test_score_only_with_n_and_usage(served, tokenizer):
    """echo + max_tokens 0 with n = 2: both choices are the prompt alone; no completion tokens are counted."""
    reply = post(served[1], "/v1/completions", {"model": MODEL, "prompt": "Return the", "max_tokens": 0,
                                                "echo": True, "n": 2, "logprobs": 0})
    assert [c["text"] for c in reply["choices"]] == ["Return the"] * 2
    assert all(len(c["logprobs"]["tokens"]) == 2 for c in reply["choices"])
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
