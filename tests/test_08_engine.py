"""The engine end to end on CPU: parity with transformers, invariance across engine paths, bad input."""
import pytest

from nanovllm_edu import LLM, SamplingParams
from nanovllm_edu.assets import tiny_model_path

from helpers import make_random_qwen3_checkpoint
from parity import engine_greedy, hf_greedy

PROMPTS = ["Return the", "This module provides a class that", "Raise ValueError if the given",
           "Create a new", "If the file does not exist, the function returns None and logs a warning; otherwise"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
SMALL = dict(max_num_seqs=16, num_kvcache_blocks=64, kvcache_block_size=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_path(), **SMALL)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    """transformers' greedy continuations of PROMPTS (float32), cut after EOS as the engine does."""
    return hf_greedy(tiny_model_path(), [llm.tokenizer.encode(p) for p in PROMPTS], GREEDY.max_tokens)


def test_greedy_matches_transformers(llm, reference_tokens):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference_tokens
    for o in outs:
        assert o["finish_reason"] in ("stop", "length")
        assert o["text"] == llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("shape", [
    dict(num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
    dict(hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=32, tie_word_embeddings=False, num_layers=3),
])
def test_greedy_matches_transformers_on_random_checkpoints(tmp_path, shape):
    path = str(make_random_qwen3_checkpoint(tmp_path, **shape))
    prompts = [[(7 * i + j) % 250 for j in range(n)] for i, n in enumerate([3, 17, 40, 9, 64])]
    reference = hf_greedy(path, prompts, 20)
    assert engine_greedy(path, prompts, 20, **SMALL) == reference
    assert engine_greedy(path, prompts, 20, **(SMALL | dict(max_num_batched_tokens=16, num_kvcache_blocks=8))) == reference


@pytest.mark.parametrize("name, args", [
    ("chunked prefill", dict(max_num_batched_tokens=8)),
    ("preemption", dict(num_kvcache_blocks=6)),
    ("no prefix caching", dict(enable_prefix_caching=False)),
    ("block size 256", dict(kvcache_block_size=256, num_kvcache_blocks=4)),
    ("one sequence at a time", dict(max_num_seqs=1)),
])
def test_engine_paths_keep_greedy_output(name, args, reference_tokens):
    llm = LLM(tiny_model_path(), **(SMALL | args))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference_tokens, name


def test_preemption_really_happens():
    llm = LLM(tiny_model_path(), **(SMALL | dict(num_kvcache_blocks=6)))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0, "a 6-block cache should force preemptions"


def test_prefix_cache_hits_on_shared_prefix(reference_tokens):
    llm = LLM(tiny_model_path(), **SMALL)
    system = "Return the number of items in the container, counting nested containers recursively. " * 2
    first = llm.generate([system + "First"], GREEDY, use_tqdm=False)[0]
    second = llm.generate([system + "Second"], GREEDY, use_tqdm=False)[0]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] >= 16 and second["num_cached_tokens"] % 16 == 0
    no_cache = LLM(tiny_model_path(), **(SMALL | dict(enable_prefix_caching=False)))
    again = no_cache.generate([system + "Second"], GREEDY, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 0 and again["token_ids"] == second["token_ids"]


def test_prompts_as_token_ids_and_per_request_params(llm):
    ids = llm.tokenizer.encode("Return the")
    params = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    outs = llm.generate([ids, "Return the"], params, use_tqdm=False)
    assert len(outs[1]["token_ids"]) == 9 and outs[1]["finish_reason"] == "length"
    assert outs[0]["token_ids"] == outs[1]["token_ids"][: len(outs[0]["token_ids"])]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate(["Return the"], sp, use_tqdm=False)[0]["token_ids"]
    crowd = llm.generate(["Create a", "Return the", "This"], [SamplingParams(temperature=1.0, max_tokens=16), sp,
                                                             SamplingParams(temperature=0.7, max_tokens=3)],
                         use_tqdm=False)[1]["token_ids"]
    assert alone == crowd
    other_seed = llm.generate(["Return the"], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True),
                              use_tqdm=False)[0]["token_ids"]
    assert other_seed != alone


def test_length_limit_by_max_model_len():
    llm = LLM(tiny_model_path(), **(SMALL | dict(max_model_len=20)))
    ids = llm.tokenizer.encode("Return the number of bytes in the buffer")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(ids) + len(out["token_ids"]) == 20


@pytest.mark.parametrize("prompts, params, match", [
    (["Return the", ""], GREEDY, "empty"),
    (["Return the", [1, 2, 10**7]], GREEDY, "outside the vocabulary"),
    (["Return the", [3, -1]], GREEDY, "outside the vocabulary"),
    (["Return the", [5] * 5000], GREEDY, "max_model_len"),
    (["Return the", "Create a"], [GREEDY], "2 prompts"),
    (["Return the", [5] * 300], SamplingParams(max_tokens=900), "KV-cache blocks"),
    (["Return the", 42], GREEDY, "string or a list of token ids"),
])
def test_bad_input_rejects_the_call_and_the_engine_carries_on(llm, prompts, params, match, reference_tokens):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.is_finished()
    assert llm.block_manager.num_free_blocks == llm.model_runner.num_kvcache_blocks
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference_tokens


def test_missing_model_and_wrong_model_type(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="qwen3"):
        LLM(str(tmp_path))


def test_invalid_sampling_params_are_rejected(llm):
    with pytest.raises(ValueError):
        llm.generate(["Return the"], SamplingParams(top_p=0.0), use_tqdm=False)


def test_interrupted_generate_frees_everything(llm, reference_tokens):
    calls = {"n": 0}
    original = llm.model_runner.launch

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(batch)

    llm.model_runner.launch = flaky
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.model_runner.launch = original
    assert llm.scheduler.is_finished()
    assert [o["token_ids"] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference_tokens


def test_engine_stops_on_the_second_eos_id_of_generation_config(tmp_path):
    """Qwen3's generation_config.json names two EOS ids; the engine stops on either (unless ignore_eos)."""
    import json
    import shutil

    folder = tmp_path / "tiny"
    shutil.copytree(tiny_model_path(), folder)
    prompt, first_eos = "Return the", 4091
    free_run = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    free = LLM(str(folder), **SMALL).generate([prompt], free_run, use_tqdm=False)[0]["token_ids"]
    stop_at = next(i for i in range(2, len(free)) if first_eos not in free[:i + 1] and free[i] not in free[:i])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [first_eos, free[stop_at]]}))
    llm = LLM(str(folder), **SMALL)
    assert llm.config.eos == (first_eos, free[stop_at])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out["token_ids"] == free[:stop_at + 1] and out["finish_reason"] == "stop"
    assert llm.generate([prompt], free_run, use_tqdm=False)[0]["token_ids"] == free
