"""Tensor parallelism on CPU (gloo, 2 ranks): greedy parity with TP=1 and transformers through chunked
prefill, preemption and prefix-cache hits; per-rank KV cache; validation. Process spawns cost seconds, so
one TP engine (a module fixture) serves every test here; shutdown and failures: test_17_tp_shutdown.py."""
import pytest
import torch

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.tp_worker import check_tp_devices

from helpers import generate_counting_ahead, without_metrics
from parity import engine_greedy, hf_greedy

PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the given",
           "Create a new", "If the file does not exist, the function returns None and logs a warning; otherwise"]
GREEDY = SamplingParams(temperature=0, max_tokens=32)
# a 6-block cache forces preemptions, a 16-token budget chunks the prefills; prefix caching is on
SETTINGS = dict(max_num_seqs=16, num_kvcache_blocks=6, kvcache_block_size=16, max_num_batched_tokens=16,
                device="cpu")  # gloo ranks on the CPU, also on a GPU machine


@pytest.fixture(scope="module")
def tp_llm():
    llm = LLM(tiny_model_path(), tensor_parallel_size=2, **SETTINGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def prompt_ids(tp_llm):
    return [tp_llm.tokenizer.encode(p) for p in PROMPTS]


def test_tp2_greedy_matches_tp1_and_transformers(tp_llm, prompt_ids):
    reference = hf_greedy(tiny_model_path(), prompt_ids, GREEDY.max_tokens)
    assert engine_greedy(tiny_model_path(), prompt_ids, GREEDY.max_tokens, **SETTINGS) == reference
    outs = tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference


def test_prefix_cache_hits_keep_output(tp_llm):
    system = "Return the number of items in the container, counting nested containers recursively. " * 2
    first = tp_llm.generate([system + "First"], GREEDY, use_tqdm=False)[0]
    second = tp_llm.generate([system + "Second"], GREEDY, use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] >= 16
    tp1 = LLM(tiny_model_path(), **(SETTINGS | dict(enable_prefix_caching=False)))
    assert second["token_ids"] == tp1.generate([system + "Second"], GREEDY, use_tqdm=False)[0]["token_ids"]


def test_tp2_matches_tp1_through_preemptions(tp_llm, prompt_ids):
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # sequences grow until they collide
    before = tp_llm.scheduler.num_preemptions
    outs = tp_llm.generate(prompt_ids, long, use_tqdm=False)
    assert tp_llm.scheduler.num_preemptions > before, "the 6-block cache should force preemptions"
    tp1 = LLM(tiny_model_path(), **SETTINGS).generate(prompt_ids, long, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in tp1]


def test_each_rank_holds_its_kv_heads(tp_llm):
    runner = tp_llm.model_runner
    cfg = tp_llm.config.hf_config
    assert runner.num_kv_heads == cfg.num_key_value_heads // 2
    assert runner.kv_cache.shape[-2] == runner.num_kv_heads
    assert runner.model.model.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2
    assert len(runner.ranks.workers.procs) == 1


def test_async_scheduling_plans_ahead_under_tp(tp_llm, prompt_ids):
    """Rank 0 broadcasts each step's sampled tokens, so a step planned ahead finds its inputs on every rank."""
    long = SamplingParams(temperature=0, max_tokens=40)
    outs, num_ahead = generate_counting_ahead(tp_llm, prompt_ids, long)
    assert num_ahead > 10
    sync = LLM(tiny_model_path(), async_scheduling=False, **SETTINGS).generate(prompt_ids, long, use_tqdm=False)
    assert [(o["token_ids"], o["finish_reason"]) for o in outs] == [(o["token_ids"], o["finish_reason"]) for o in sync]


def test_sampled_requests_run_under_tp(tp_llm):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=8, seed=3)
    first = tp_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert without_metrics(first) == without_metrics(tp_llm.generate(PROMPTS[:2], params, use_tqdm=False))  # seeded: reproducible


def test_invalid_sizes_fail_before_spawning():
    with pytest.raises(ValueError, match="must divide the attention heads"):
        LLM(tiny_model_path(), tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="needs 4 GPUs but 2 are visible"):
        check_tp_devices(4, torch.device("cuda"), num_gpus=2)
    check_tp_devices(8, torch.device("cpu"), num_gpus=0)  # CPU ranks need no GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_on_two_gpus_matches_transformers(tp_llm):
    """NCCL + CUDA graphs on each rank (float32 tiny model): the same greedy tokens as transformers,
    with async scheduling on and off."""
    prompt_ids = [tp_llm.tokenizer.encode(p) for p in PROMPTS]
    tp_llm.exit()  # one TP engine per process: the CPU one (the last test to use it) goes first
    reference = hf_greedy(tiny_model_path(), prompt_ids, GREEDY.max_tokens)
    for eager, overlap in ((True, True), (False, True), (False, False)):
        with LLM(tiny_model_path(), tensor_parallel_size=2, device="cuda", enforce_eager=eager,
                 async_scheduling=overlap, max_num_seqs=16, kvcache_block_size=256) as llm:
            outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == reference, f"enforce_eager={eager}, async={overlap}"
            assert llm.model_runner.num_kv_heads == 1 and llm.model_runner.device.index == 0


def test_tp2_sampling_fields_match_tp1(tp_llm):
    """n > 1 copies a block on every rank; penalties, logprobs and stops run on rank 0: TP=2 equals TP=1."""
    prompt = "Return the value of the operand. " * 2  # a partly filled last block, copied for the forks
    params = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, n=3, logprobs=1, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, stop=" of")]
    outs = tp_llm.generate([prompt, "Create a new"], params, use_tqdm=False)
    tp1 = LLM(tiny_model_path(), **SETTINGS).generate([prompt, "Create a new"], params, use_tqdm=False)
    for out, ref in zip(outs, tp1):
        assert [(o["token_ids"], o["text"], o["stop_reason"]) for o in out["outputs"]] == \
               [(o["token_ids"], o["text"], o["stop_reason"]) for o in ref["outputs"]]
        for got, want in zip((out["prompt_logprobs"] or [])[1:], (ref["prompt_logprobs"] or [])[1:]):
            assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)
        for o, r in zip(out["outputs"], ref["outputs"]):
            for got, want in zip(o["logprobs"] or [], r["logprobs"] or []):
                assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)
