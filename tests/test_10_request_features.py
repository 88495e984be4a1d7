"""Lesson 10's request features end to end on CPU: stop strings and stop ids, results, chat, n > 1 completions
sharing one prefill, and the refusals of what this engine cannot serve (the logit processors: test_09_sampling.py)."""
import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path

from helpers import make_random_qwen3_checkpoint

SMALL = dict(max_num_seqs=8, num_kvcache_blocks=64, kvcache_block_size=16)
PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM(tiny_model_path(), async_scheduling=request.param, **SMALL)


def test_stop_strings_end_the_text_before_them(llm):
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, plain):
        stop = ref["text"][5:9]  # four characters from inside the completion, likely spanning a token boundary
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop, "never seen"]),
                           use_tqdm=False)[0]
        cut = ref["text"].index(stop)
        assert out["text"] == ref["text"][:cut] and out["finish_reason"] == "stop" and out["stop_reason"] == stop
        n = len(out["token_ids"])
        assert out["token_ids"] == ref["token_ids"][:n]
        assert stop in llm.tokenizer.decode(out["token_ids"]) and stop not in llm.tokenizer.decode(out["token_ids"][:-1])


def test_stop_token_ids_and_both_eos_paths(llm):
    ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    ids = ref["token_ids"]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop_token_ids=[ids[k]]), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop" and out["stop_reason"] == ids[k]
    assert out["text"] == llm.tokenizer.decode(ids[:k], skip_special_tokens=True)  # the stop id's text is left out
    at_length = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=k + 1, ignore_eos=True,
                                                          stop_token_ids=[ids[k]]), use_tqdm=False)[0]
    assert at_length["finish_reason"] == "stop" and at_length["stop_reason"] == ids[k]  # a stop wins over length
    eos = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for out in eos:
        if out["finish_reason"] == "stop":
            assert out["token_ids"][-1] in llm.config.eos and out["stop_reason"] is None


def test_result_fields(llm):
    out = llm.generate(["Return the"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert set(out) == {"text", "token_ids", "finish_reason", "stop_reason", "num_cached_tokens", "prompt_token_ids",
                        "logprobs", "prompt_logprobs", "prompt_logprob_ranks", "cumulative_logprob", "outputs",
                        "metrics"}
    assert out["prompt_token_ids"] == llm.tokenizer.encode("Return the") and out["logprobs"] is None
    assert out["cumulative_logprob"] is None and out["prompt_logprobs"] is None and out["prompt_logprob_ranks"] is None
    assert out["outputs"] == [{k: out[k] for k in ("text", "token_ids", "finish_reason", "stop_reason", "logprobs",
                                                  "cumulative_logprob")}]


def test_chat_equals_generate_on_the_templated_ids(llm):
    conversations = [[{"role": "user", "content": "Return the"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Create a new"}]]
    params = SamplingParams(temperature=0, max_tokens=8)
    chats = llm.chat(conversations, params, use_tqdm=False)
    ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False) for c in conversations]
    assert [c["token_ids"] for c in chats] == [o["token_ids"] for o in llm.generate(ids, params, use_tqdm=False)]
    assert chats[0]["prompt_token_ids"] == ids[0]
    assert llm.chat(conversations[0], params, use_tqdm=False)[0]["token_ids"] == chats[0]["token_ids"]
    for bad in ([{"content": "no role"}], "Return the", [], [[]]):
        with pytest.raises(ValueError, match="messages must be a conversation"):
            llm.chat(bad)


@pytest.mark.parametrize("params, message", [
    (dict(prompt_logprobs=4097), r"prompt_logprobs=4097 asks for more tokens than the vocabulary holds"),
    (dict(stop_token_ids=[4096]), r"stop_token_ids holds 4096, outside the vocabulary \[0, 4096\)"),
    (dict(logprobs=5000), r"logprobs=5000 asks for more tokens than the vocabulary holds"),
])
def test_what_is_not_served_is_refused_before_any_work(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPTS, [SamplingParams(), SamplingParams(**params), SamplingParams()], use_tqdm=False)
    assert llm.is_finished()
    assert llm.generate(["Return the"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]["token_ids"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"), (dict(repetition_penalty=0.0), r"repetition_penalty must be a number > 0"),
    (dict(presence_penalty=float("nan")), r"presence_penalty must be in \[-2, 2\]"),
    (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\] \(vLLM's range"),
    (dict(frequency_penalty=-2.5), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty="1"), r"frequency_penalty must be in \[-2, 2\]"), (dict(n=0), r"n must be an integer >= 1"),
    (dict(logprobs=True), r"logprobs must be None or an integer >= 0"), (dict(prompt_logprobs=-2), r"prompt_logprobs must be"),
    (dict(stop=["ok", ""]), r"stop must be None, a non-empty string"), (dict(stop=5), r"stop must be None"),
    (dict(stop_token_ids=7), r"stop_token_ids must be None or a list of token ids"),
])
def test_bad_sampling_values_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_strings_need_a_tokenizer(tmp_path):
    folder = make_random_qwen3_checkpoint(tmp_path)
    weights_only = LLM(str(folder), num_kvcache_blocks=8, kvcache_block_size=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        weights_only.generate([[1, 2, 3]], SamplingParams(stop="x"), use_tqdm=False)
    out = weights_only.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, logprobs=1), use_tqdm=False)[0]
    assert len(out["logprobs"]) == 3 and out["text"] == ""


class PrefillTokens:
    """Counts the prompt tokens the engine's prefill steps compute."""

    def __init__(self, engine):
        self.engine, self.tokens = engine, 0

    def run(self, prompts, params):
        seqs = self.engine.make_requests(prompts, params)
        for seq in seqs:
            self.engine.scheduler.add(seq)
        for step in self.engine.steps():
            self.tokens += step.num_tokens if step.is_prefill else 0
        return [self.engine.result(seq) for seq in seqs]


def test_n_completions_share_one_prefill(llm):
    prompt = llm.tokenizer.encode("This module provides a class that " * 3)  # 2 full blocks and a partial one
    counter = PrefillTokens(llm)
    out = counter.run([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=4))[0]
    assert counter.tokens == len(prompt)  # one prompt's worth, not four
    texts = [o["token_ids"] for o in out["outputs"]]
    assert len(texts) == 4 and len({tuple(t) for t in texts}) > 1 and out["token_ids"] == texts[0]
    again = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=12, n=4), use_tqdm=False)[0]
    assert [o["token_ids"] for o in again["outputs"]] == texts  # seeded: each completion is reproducible
    alone = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=12), use_tqdm=False)[0]
             for i in range(4)]
    assert [a["token_ids"] for a in alone] == texts  # completion i is the request with seed + i
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks - len(
        [b for b in llm.block_manager.blocks if b.ref_count])


def test_n_greedy_completions_equal_greedy_and_keep_their_own_fields(llm):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, n=3, logprobs=1), use_tqdm=False)
    for out, ref in zip(outs, greedy):
        assert [o["token_ids"] for o in out["outputs"]] == [ref["token_ids"]] * 3
        assert all(len(o["logprobs"]) == len(o["token_ids"]) for o in out["outputs"])
        assert out["prompt_token_ids"] == ref["prompt_token_ids"]


def test_n_completions_of_one_token(llm):
    """max_tokens=1: async scheduling ends the parent at launch and frees its blocks before the forks start
    (each fork then ends at its first token too, with no blocks of its own); nothing leaks."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, n=3, prompt_logprobs=1), use_tqdm=False)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for out, ref in zip(outs, greedy):
        assert [o["token_ids"] for o in out["outputs"]] == [ref["token_ids"]] * 3
        assert {o["finish_reason"] for o in out["outputs"]} <= {"length", "stop"}
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_n_completions_survive_preemption():
    tight = LLM(tiny_model_path(), max_num_seqs=8, num_kvcache_blocks=5, kvcache_block_size=16)
    prompt = tight.tokenizer.encode("Return the value of the operand. " * 2)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=4)
    out = tight.generate([prompt], params, use_tqdm=False)[0]
    reference = LLM(tiny_model_path(), **SMALL).generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                                                   ignore_eos=True), use_tqdm=False)[0]
    assert tight.scheduler.num_preemptions > 0
    assert [o["token_ids"] for o in out["outputs"]] == [reference["token_ids"]] * 4


# --- min_tokens and the stop strings; the text's three settings; the chat flags -----------------------------

def test_stop_strings_wait_for_min_tokens(llm):
    plain = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ids = plain["token_ids"]
    newline = ids.index(llm.tokenizer.encode("\n")[0]) + 1  # the newline is the completion's newline-th token
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop="\n", min_tokens=newline - 1),
                       use_tqdm=False)[0]
    assert cut["stop_reason"] == "\n" and cut["token_ids"] == ids[:newline]
    kept = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop="\n", min_tokens=newline),
                        use_tqdm=False)[0]
    assert "\n" in kept["text"] and kept["token_ids"] == ids and kept["stop_reason"] is None
    # a match that begins within min_tokens and ends after it still stops the completion (vLLM's search)
    span = llm.tokenizer.decode(ids[newline - 2:newline + 1])  # three tokens, the newline in the middle
    spanned = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop=span,
                                                        min_tokens=newline), use_tqdm=False)[0]
    assert spanned["stop_reason"] == span and spanned["token_ids"] == ids[:newline + 1]


def test_include_stop_str_in_output_keeps_the_stop(llm):
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, ref in zip(PROMPTS, plain):
        stop = ref["text"][5:9]  # likely to end inside a token: the text must end right after the stop anyway
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
        assert out["text"] == ref["text"][:ref["text"].index(stop) + len(stop)] and out["stop_reason"] == stop
    ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    stop_id = ref["token_ids"][3]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0]
    assert out["text"] == llm.tokenizer.decode(ref["token_ids"][:4])  # the stop id's text is kept too (vLLM)
    eos = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, include_stop_str_in_output=True,
                                                    skip_special_tokens=False), use_tqdm=False)[0]
    assert eos["finish_reason"] == "stop" and eos["text"].endswith(llm.tokenizer.eos_token)


def test_skip_special_tokens_false_keeps_them_in_the_text_only(llm):
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    skipped = llm.generate([PROMPTS[2]], SamplingParams(**params), use_tqdm=False)[0]
    kept = llm.generate([PROMPTS[2]], SamplingParams(**params, skip_special_tokens=False), use_tqdm=False)[0]
    assert set(llm.config.eos) & set(kept["token_ids"]), "no EOS inside the completion: the test shows nothing"
    assert kept["text"] == llm.tokenizer.decode(kept["token_ids"], skip_special_tokens=False)
    assert llm.tokenizer.eos_token in kept["text"] and llm.tokenizer.eos_token not in skipped["text"]
    assert kept["token_ids"] == skipped["token_ids"] and kept["logprobs"] == skipped["logprobs"]
    stopped = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False),
                           use_tqdm=False)[0]
    assert stopped["finish_reason"] == "stop" and llm.tokenizer.eos_token not in stopped["text"]  # EOS: a stop


def test_spaces_between_special_tokens_is_passed_to_decode(llm, monkeypatch):
    calls = []
    decode = llm.tokenizer.decode

    def recording(ids, **kwargs):
        calls.append(kwargs)
        return decode(ids, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", recording)
    texts = []
    for spaces in (True, False):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, skip_special_tokens=False,
                                spaces_between_special_tokens=spaces, stop="never seen")
        texts.append(llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]["text"])
        assert calls and all(c.get("spaces_between_special_tokens") is spaces for c in calls)
        calls.clear()
    assert texts[0] == texts[1]  # transformers' fast tokenizers ignore it (as vLLM's fast detokenizer does)


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "skip_special_tokens",
                                  "spaces_between_special_tokens", "ignore_eos"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_the_text_flags_are_true_or_false(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be True or False, got {value!r}"):
        SamplingParams(**{name: value})


def test_the_engine_of_lesson_08_refuses_the_new_fields():
    from nanovllm_edu.engine.llm_engine import requested_features

    asked = requested_features(SamplingParams(min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False,
                                              spaces_between_special_tokens=False))
    assert asked == ["min_tokens=2", "include_stop_str_in_output=True", "skip_special_tokens=False",
                     "spaces_between_special_tokens=False"]
    assert requested_features(SamplingParams()) == []


def test_render_chat_follows_vllms_flags(llm):
    from nanovllm_edu.engine.llm_engine import render_chat

    tok, question = llm.tokenizer, [{"role": "user", "content": "Return the"}]
    started = question + [{"role": "assistant", "content": "It returns"}]
    template = lambda conv, **kw: tok.encode(tok.apply_chat_template(conv, tokenize=False, **kw),
                                             add_special_tokens=False)
    assert render_chat(tok, question) == template(question, add_generation_prompt=True)
    closed = render_chat(tok, question, add_generation_prompt=False)
    assert closed == template(question) and tok.decode(closed).endswith("<|im_end|>\n")
    opened = render_chat(tok, started, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(opened).endswith("<|im_start|>assistant\nIt returns")
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    assert tok.decode(render_chat(tok, question, chat_template=own)) == "user: Return the\nA:"
    for conv, kwargs, message in [
            (started, dict(continue_final_message=True), "add_generation_prompt and continue_final_message cannot"),
            (question, dict(add_generation_prompt=False, continue_final_message=True), "needs the last message"),
            (question, dict(add_generation_prompt="yes"), "add_generation_prompt must be True or False"),
            (question, dict(continue_final_message=1), "continue_final_message must be True or False"),
            (question, dict(chat_template=5), "chat_template must be None or a Jinja template")]:
        with pytest.raises(ValueError, match=message):
            render_chat(tok, conv, **kwargs)
    with pytest.raises(ValueError, match="a chat needs a tokenizer"):
        render_chat(None, question)


def test_chat_takes_the_flags_and_equals_generate_on_render_chat(llm):
    from nanovllm_edu.engine.llm_engine import render_chat

    started = [{"role": "user", "content": "What does this function return?"},
               {"role": "assistant", "content": "It returns"}]
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.chat(started, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    ids = render_chat(llm.tokenizer, started, add_generation_prompt=False, continue_final_message=True)
    assert out["prompt_token_ids"] == ids
    assert out["token_ids"] == llm.generate([ids], params, use_tqdm=False)[0]["token_ids"]
    own = "{% for m in messages %}{{ m.content }}{% endfor %}"
    mine = llm.chat(started[:1], params, use_tqdm=False, chat_template=own)[0]
    assert mine["prompt_token_ids"] == llm.tokenizer.encode(started[0]["content"], add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(started, params, continue_final_message=True)
    assert llm.is_finished()
