"""Lesson 09's logit processors end to end on CPU: penalties and min_p, logprobs and prompt logprobs against
transformers' logits (the engine's own features, stop strings, n > 1, results and chat: test_10_request_features.py)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path

from helpers import make_random_qwen3_checkpoint

SMALL = dict(max_num_seqs=8, num_kvcache_blocks=64, kvcache_block_size=16)
PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the"]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request):
    return LLM(tiny_model_path(), async_scheduling=request.param, **SMALL)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path(), local_files_only=True).eval()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def reference_penalised_greedy(hf, prompt: list[int], steps: int, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding step by step on transformers' logits, penalised as vLLM defines it (a plain loop)."""
    out = []
    for _ in range(steps):
        logits = hf_logits(hf, prompt + out).clone()
        for token in set(prompt) | set(out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("penalties", [dict(repetition=1.8), dict(presence=1.5), dict(frequency=0.7),
                                       dict(presence=0.5, frequency=0.5, repetition=1.3)])
def test_penalties_equal_a_step_by_step_reference(llm, hf, penalties):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=penalties.get("presence", 0.0),
                            frequency_penalty=penalties.get("frequency", 0.0),
                            repetition_penalty=penalties.get("repetition", 1.0))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for prompt, out, base in zip(prompts, outs, plain):
        assert out["token_ids"] == reference_penalised_greedy(hf, prompt, 16, **penalties)
    assert any(o["token_ids"] != b["token_ids"] for o, b in zip(outs, plain))  # the penalty did something
    assert not llm.model_runner.token_counts.row_of  # every finished request gave its row back


def test_penalised_and_plain_requests_share_a_batch(llm, hf):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    mixed = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0)]
    outs = llm.generate(prompts, mixed, use_tqdm=False)
    assert outs[0]["token_ids"] == reference_penalised_greedy(hf, prompts[0], 12, repetition=2.0)
    assert outs[1]["token_ids"] == reference_penalised_greedy(hf, prompts[1], 12)
    assert outs[2]["token_ids"] == reference_penalised_greedy(hf, prompts[2], 12, frequency=1.0)


def test_penalties_survive_preemption(hf):
    tight = LLM(tiny_model_path(), max_num_seqs=8, num_kvcache_blocks=6, kvcache_block_size=16)
    prompts = [tight.tokenizer.encode(p) * 3 for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.6, presence_penalty=0.3)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out["token_ids"] == reference_penalised_greedy(hf, prompt, 20, presence=0.3, repetition=1.6)


def test_logprobs_are_the_raw_distribution_of_transformers(llm, hf):
    prompt = llm.tokenizer.encode(PROMPTS[1])
    for params in (SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                   SamplingParams(temperature=1.3, top_k=5, max_tokens=6, logprobs=0, seed=11, repetition_penalty=1.2)):
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert len(out["logprobs"]) == len(out["token_ids"]) and out["outputs"][0]["logprobs"] == out["logprobs"]
        total = 0.0
        for i, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            reference = torch.log_softmax(hf_logits(hf, prompt + out["token_ids"][:i]), -1)
            best = reference.topk(params.logprobs).indices.tolist()
            assert set(top) == set(best) | {token} and len(top) in (params.logprobs, params.logprobs + 1)
            for t, lp in top.items():
                assert abs(lp - reference[t].item()) < 2e-3
            total += top[token]
        assert out["cumulative_logprob"] == pytest.approx(total, abs=1e-4)


def test_min_p_one_is_greedy_and_min_p_narrows_sampling(llm):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    min_p_one = llm.generate(prompts, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10), use_tqdm=False)
    assert [o["token_ids"] for o in min_p_one] == [o["token_ids"] for o in greedy]
    params = SamplingParams(temperature=1.5, min_p=0.3, max_tokens=1, logprobs=50)
    firsts = llm.generate([prompts[0]] * 16, [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(16)],
                          use_tqdm=False)
    for out in firsts:  # every sampled token had at least 0.3 x the best probability at T = 1.5
        lps = out["logprobs"][0]
        best = max(lps.values())
        assert (lps[out["token_ids"][0]] - best) / 1.5 >= torch.log(torch.tensor(0.3)).item() - 1e-4


def check_prompt_logprobs(out, prompt: list[int], hf, k: int) -> None:
    """Position 0 is None; every other holds the actual token and the top k of transformers' log_softmax, and
    the actual token's rank in it (1 + how many tokens are more likely; no near-ties in these rows)."""
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(prompt)
    assert out["prompt_logprob_ranks"][0] is None and len(out["prompt_logprob_ranks"]) == len(prompt)
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for position in range(1, len(prompt)):
        entry, row = out["prompt_logprobs"][position], reference[position - 1]
        assert set(entry) == set(row.topk(k).indices.tolist()) | {prompt[position]}
        for token, lp in entry.items():
            assert abs(lp - row[token].item()) < 2e-3
        assert out["prompt_logprob_ranks"][position] == 1 + (row > row[prompt[position]]).sum().item()


@pytest.mark.parametrize("budget", [None, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers(hf, budget):
    engine = LLM(tiny_model_path(), **SMALL, **({"max_num_batched_tokens": budget} if budget else {}))
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(out, prompt, hf, 2)


def test_prompt_logprobs_take_no_prefix_hits(llm, hf):
    prompt = llm.tokenizer.encode("Return the number of items in the container, counting nested ones. " * 3)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # cache the prompt
    assert llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]["num_cached_tokens"] > 0
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert out["num_cached_tokens"] == 0
    check_prompt_logprobs(out, prompt, hf, 0)


def test_prompt_logprobs_on_a_random_checkpoint(tmp_path):
    folder = make_random_qwen3_checkpoint(tmp_path, vocab_size=300)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    engine = LLM(str(folder), num_kvcache_blocks=16, kvcache_block_size=16, max_num_batched_tokens=20)
    prompt = [(7 * i + 3) % 299 for i in range(45)]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2),
                          use_tqdm=False)[0]
    check_prompt_logprobs(out, prompt, hf, 3)
    assert len(out["outputs"]) == 2


def test_penalties_and_logprobs_on_a_random_checkpoint(tmp_path):
    folder = make_random_qwen3_checkpoint(tmp_path, vocab_size=300, num_layers=3, hidden_size=96, num_heads=6,
                                          num_kv_heads=2, head_dim=32, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    engine = LLM(str(folder), num_kvcache_blocks=16, kvcache_block_size=16)
    prompts = [[(5 * i + 11 * j) % 299 for j in range(n)] for i, n in enumerate((7, 23, 40))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.4,
                            frequency_penalty=0.3, logprobs=2)
    for prompt, out in zip(prompts, engine.generate(prompts, params, use_tqdm=False)):
        assert out["token_ids"] == reference_penalised_greedy(hf, prompt, 10, frequency=0.3, repetition=1.4)
        for i, top in enumerate(out["logprobs"]):
            reference = torch.log_softmax(hf_logits(hf, prompt + out["token_ids"][:i]), -1)
            assert all(abs(lp - reference[t].item()) < 2e-3 for t, lp in top.items())


# --- min_tokens: the stop tokens masked before the draw ----------------------------------------------------

def reference_min_tokens_greedy(hf, prompt: list[int], steps: int, min_tokens: int, stops: set[int]) -> list[int]:
    """Greedy on transformers' logits, every id of `stops` at -inf while the output is shorter than min_tokens
    (vLLM's MinTokensLogitsProcessor); the output ends at its first stop, as the engine's does."""
    out = []
    while len(out) < steps:
        logits = hf_logits(hf, prompt + out).clone()
        if len(out) < min_tokens:
            logits[sorted(stops)] = float("-inf")
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            break
    return out


def test_min_tokens_pushes_greedy_past_its_eos_as_transformers_with_the_eos_masked(llm, hf):
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    eos = set(llm.config.eos)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    early = [i for i, out in enumerate(plain) if out["finish_reason"] == "stop" and len(out["token_ids"]) < 10]
    assert early, "no prompt ends at its EOS before 10 tokens: the test would show nothing"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, min_tokens=10), use_tqdm=False)
    for prompt, out, base in zip(prompts, outs, plain):
        assert not eos & set(out["token_ids"][:10])
        assert out["token_ids"] == reference_min_tokens_greedy(hf, prompt, 20, 10, eos)
        k = len(base["token_ids"]) - 1  # the tokens before the plain run's EOS are the same
        assert out["token_ids"][:min(k, 10)] == base["token_ids"][:min(k, 10)]
    for i in early:
        assert len(outs[i]["token_ids"]) > 10 and outs[i]["token_ids"] != plain[i]["token_ids"]
    # transformers' own rule (min_new_tokens) agrees on the prompt that stops early
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[early[0]]]), do_sample=False, max_new_tokens=20, min_new_tokens=10,
                          eos_token_id=sorted(eos), pad_token_id=min(eos))[0, len(prompts[early[0]]):].tolist()
    assert outs[early[0]]["token_ids"] == ref[:len(outs[early[0]]["token_ids"])]


def test_min_tokens_masks_stop_token_ids_and_leaves_eos_to_ignore_eos(llm, hf):
    prompt = llm.tokenizer.encode(PROMPTS[2])
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop_id = ref["token_ids"][2]  # the third token would stop the request
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=6,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert stop_id not in out["token_ids"][:6]
    assert out["token_ids"] == reference_min_tokens_greedy(hf, prompt, 12, 6, {stop_id})
    # with ignore_eos the EOS is no stop, so min_tokens leaves it alone: the run is the plain ignore_eos run
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=12),
                        use_tqdm=False)[0]
    assert kept["token_ids"] == ref["token_ids"] and set(llm.config.eos) & set(ref["token_ids"])
    assert not llm.model_runner.token_counts.row_of


def test_min_tokens_leaves_logprobs_to_the_raw_distribution(llm):
    prompt = llm.tokenizer.encode(PROMPTS[2])
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=1), use_tqdm=False)[0]
    eos_at = len(plain["token_ids"]) - 1
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=1, min_tokens=10),
                        use_tqdm=False)[0]
    eos = plain["token_ids"][eos_at]
    assert eos in llm.config.eos and held["token_ids"][eos_at] != eos
    assert eos in held["logprobs"][eos_at]  # the EOS is still the most likely token of the raw row
    assert held["logprobs"][eos_at][eos] == pytest.approx(plain["logprobs"][eos_at][eos], abs=1e-4)


PARITY_PATHS = {"async": dict(async_scheduling=True), "sync": dict(async_scheduling=False),
                "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=5),
                "preempted": dict(num_kvcache_blocks=5, max_num_seqs=8),
                "no prefix cache": dict(enable_prefix_caching=False)}


def test_min_tokens_is_the_same_on_every_path(hf):
    prompts = [PROMPTS[2], "Raise ValueError if the value is negative. " * 3 + PROMPTS[2], PROMPTS[0]] * 2
    params = [SamplingParams(temperature=0, max_tokens=24, min_tokens=m) for m in (10, 18, 5, 24, 0, 12)]
    results = {}
    for name, args in PARITY_PATHS.items():
        engine = LLM(tiny_model_path(), **(SMALL | args))
        ids = [engine.tokenizer.encode(p) for p in prompts]
        results[name] = [o["token_ids"] for o in engine.generate(ids, params, use_tqdm=False)]
        if name == "preempted":
            assert engine.scheduler.num_preemptions > 0
        if name == "async":  # again, the prompts now in the prefix cache
            again = engine.generate(ids, params, use_tqdm=False)
            assert [o["token_ids"] for o in again] == results[name] and any(o["num_cached_tokens"] for o in again)
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), results
    eos = set(engine.config.eos)
    assert first[:3] == [reference_min_tokens_greedy(hf, p, 24, sp.min_tokens, eos) for p, sp in zip(ids[:3], params)]


def test_min_tokens_counts_placeholders_and_masks_only_short_rows():
    from nanovllm_edu.engine.sequence import Sequence, append_placeholder
    from nanovllm_edu.layers.sampler import SamplingInputs
    from nanovllm_edu.layers.sampling_features import TokenCounts, add_request_inputs

    cpu, counts = torch.device("cpu"), TokenCounts(16, torch.device("cpu"))
    plain = SamplingInputs(torch.zeros(3))
    seqs = [Sequence([1, 2], SamplingParams(temperature=0), 16) for _ in range(3)]
    assert add_request_inputs(plain, seqs, counts, cpu, (7,)) is plain and plain.stop_mask is None  # nothing asked
    short = Sequence([1, 2], SamplingParams(min_tokens=2, stop_token_ids=[3]), 16)
    done = Sequence([1, 2], SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=[5]), 16)
    append_placeholder(short)  # a token planned but not known yet counts: 1 < 2, still short
    append_placeholder(done)  # 1 >= 1: past its min_tokens
    asked = add_request_inputs(SamplingInputs(torch.zeros(3)), [seqs[0], short, done], counts, cpu, (7, 3))
    assert [t.tolist() for t in asked.stop_mask] == [[1, 1], [3, 7]]
    append_placeholder(short)
    assert add_request_inputs(SamplingInputs(torch.zeros(1)), [short], counts, cpu, (7,)).stop_mask is None


def test_the_sampler_is_handed_the_masked_logits_and_logprobs_the_raw_ones():
    from nanovllm_edu.layers.sampler import SamplingInputs
    from nanovllm_edu.layers.sampling_features import TokenCounts, sample_with_features

    logits = torch.tensor([[5.0, 1.0, 0.0, 2.0], [5.0, 1.0, 0.0, 2.0]])
    seen = []

    def draw(masked, *args):
        seen.append(masked)
        return masked.argmax(-1)

    sampling = SamplingInputs(torch.zeros(2), all_greedy=True, stop_mask=(torch.tensor([0, 0]), torch.tensor([0, 3])),
                              logprob_rows=torch.tensor([0]), logprob_k=1)
    tokens, (_, _, top_ids, _) = sample_with_features(draw, logits, sampling, TokenCounts(4, torch.device("cpu")))
    assert tokens.tolist() == [1, 0] and seen[0][0].tolist() == [float("-inf"), 1.0, 0.0, float("-inf")]
    assert logits[0, 0] == 5.0 and top_ids.tolist() == [[0]]  # the caller's logits untouched; logprobs raw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton sampler runs on a GPU")
def test_min_tokens_on_the_gpu_with_the_triton_sampler_and_cuda_graphs():
    gpu = LLM(tiny_model_path(), device="cuda", **SMALL)
    assert type(gpu.model_runner.sampler).__name__ == "TritonSampler"
    cpu = LLM(tiny_model_path(), device="cpu", **SMALL)
    params = [SamplingParams(temperature=0, max_tokens=20, min_tokens=10),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, min_tokens=12)]
    prompts = [PROMPTS[2], PROMPTS[2]]
    outs = gpu.generate(prompts, params, use_tqdm=False)
    assert not set(gpu.config.eos) & set(outs[0]["token_ids"][:10] + outs[1]["token_ids"][:12])
    assert outs[0]["token_ids"][:10] == cpu.generate(prompts[:1], params[:1], use_tqdm=False)[0]["token_ids"][:10]


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_tokens=-1), r"min_tokens must be an integer in 0\.\.max_tokens \(64\), got -1"),
    (dict(max_tokens=8, min_tokens=9), r"min_tokens must be an integer in 0\.\.max_tokens \(8\), got 9"),
    (dict(min_tokens=1.5), r"min_tokens must be"), (dict(min_tokens=True), r"min_tokens must be"),
    (dict(min_tokens="3"), r"min_tokens must be"),
])
def test_bad_min_tokens_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8
