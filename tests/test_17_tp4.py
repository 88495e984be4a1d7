"""Tensor parallelism with 4 ranks on CPU (gloo): float32 greedy parity with TP=1 and transformers through
chunked prefill, preemption and prefix-cache hits; each rank holds a quarter of the KV heads. The shipped
tiny model has 2 KV heads, so a random spread-init checkpoint with 8 query / 4 KV heads (no tokenizer:
prompts are token ids) stands in. One TP=4 engine (a module fixture) serves every test: spawns cost seconds."""
import pytest
import torch

from nanovllm_edu import LLM, SamplingParams

from helpers import make_random_qwen3_checkpoint
from parity import hf_greedy

TP = 4
VOCAB = 256  # eos (and pad) is the last id, 255; prompts never contain it
SHAPE = dict(hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=4, head_dim=16, vocab_size=VOCAB,
             intermediate_size=128, max_position_embeddings=512)  # every split size divisible by 4
SEED = 6  # with these prompts every greedy step's top-2 logit gap is >= 0.04 (float32 noise: ~1e-5)
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# a 16-token budget chunks every prefill but the shortest; 6 blocks of 16 slots hold the longest request
# (45 + 24 tokens = 5 blocks) but not all five at once, so decoding forces preemptions; prefix caching is on
SETTINGS = dict(max_num_seqs=16, num_kvcache_blocks=6, kvcache_block_size=16, max_num_batched_tokens=16,
                device="cpu")
PROMPT_LENS = (3, 9, 17, 30, 45)


def _token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_token_ids(n, seed) for seed, n in enumerate(PROMPT_LENS)]
SYSTEM = _token_ids(37, 100)  # a shared prefix: two full 16-token blocks, then five more tokens
PREFIXED = [SYSTEM + _token_ids(4, 101), SYSTEM + _token_ids(6, 102)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_random_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3_tp4"), seed=SEED, **SHAPE))


@pytest.fixture(scope="module")
def tp_llm(model_path):
    llm = LLM(model_path, tensor_parallel_size=TP, **SETTINGS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def tp1_llm(model_path):
    "The single-rank reference, with the same small cache and budget but no prefix caching."
    return LLM(model_path, **(SETTINGS | dict(enable_prefix_caching=False)))


def test_tp4_greedy_matches_tp1_and_transformers(tp_llm, tp1_llm, model_path):
    reference = hf_greedy(model_path, PROMPTS, MAX_TOKENS)
    assert any(len(row) == MAX_TOKENS for row in reference)  # at least one long request: blocks run short
    tp1 = tp1_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in tp1] == reference
    before = tp_llm.scheduler.num_preemptions
    outs = tp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tp_llm.scheduler.num_preemptions > before, "the 6-block cache should force preemptions"
    assert [o["token_ids"] for o in outs] == reference


def test_tp4_prefix_cache_hits_keep_output(tp_llm, tp1_llm, model_path):
    first = tp_llm.generate([PREFIXED[0]], GREEDY, use_tqdm=False)[0]
    second = tp_llm.generate([PREFIXED[1]], GREEDY, use_tqdm=False)[0]
    assert second["num_cached_tokens"] >= 16, "the shared 37-token prefix should hit the prefix cache"
    expected = tp1_llm.generate(PREFIXED, GREEDY, use_tqdm=False)
    assert all(o["num_cached_tokens"] == 0 for o in expected)  # the reference computes every token
    assert [first["token_ids"], second["token_ids"]] == [o["token_ids"] for o in expected]
    assert [o["token_ids"] for o in expected] == hf_greedy(model_path, PREFIXED, MAX_TOKENS)


def test_each_of_four_ranks_holds_a_quarter_of_the_kv_heads(tp_llm):
    runner = tp_llm.model_runner
    cfg = tp_llm.config.hf_config
    assert cfg.num_key_value_heads == 4 and cfg.num_attention_heads == 8
    assert runner.num_kv_heads == 1
    assert runner.kv_cache.shape[-2] == 1
    assert runner.model.model.layers[0].self_attn.num_heads == 2
    assert len(runner.ranks.workers.procs) == TP - 1
    assert all(proc.is_alive() for proc in runner.ranks.workers.procs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < TP, reason="needs four CUDA GPUs")
def test_tp4_on_four_gpus_matches_transformers(tp_llm, model_path):
    """NCCL, CUDA graphs and async scheduling on four GPUs (float32): transformers' greedy tokens."""
    tp_llm.exit()  # one TP engine per process: the CPU one goes first
    reference = hf_greedy(model_path, PROMPTS, MAX_TOKENS)
    for eager in (True, False):
        with LLM(model_path, tensor_parallel_size=TP, device="cuda", enforce_eager=eager, max_num_seqs=16,
                 kvcache_block_size=16, num_kvcache_blocks=64) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == reference, f"enforce_eager={eager}"
            assert llm.model_runner.num_kv_heads == 1 and len(llm.model_runner.ranks.workers.procs) == TP - 1
