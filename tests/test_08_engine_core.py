"""Notebook 08's EngineCore and the seams notebook 09 fills: the core engine generates what transformers
does, refuses (before any work, naming the field) what only LLMEngine does, and stays usable; a runner
without request features refuses them too; LLMEngine refuses a runner that would ignore them."""
import pytest
import torch

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.config import Config
from nanovllm_edu.engine.engine_core import EngineCore
from nanovllm_edu.engine.llm_engine import LLMEngine, RequestFeatures
from nanovllm_edu.engine.model_runner import ModelRunner, NoFeatures, requested_features
from nanovllm_edu.engine.sequence import Sequence
from nanovllm_edu.sampling_params import SamplingParams

from parity import hf_greedy

SMALL = dict(device="cpu", max_num_seqs=8, num_kvcache_blocks=32, kvcache_block_size=16)
PROMPTS = ["Return the", "Create a new", "Raise ValueError if the given"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
FEATURES = [dict(n=2), dict(stop=["."]), dict(stop_token_ids=[5]), dict(logprobs=1), dict(prompt_logprobs=1),
            dict(presence_penalty=0.5), dict(frequency_penalty=0.5), dict(repetition_penalty=1.2), dict(min_p=0.1)]


@pytest.fixture(scope="module")
def core():
    return EngineCore(tiny_model_path(), **SMALL)


def test_core_greedy_matches_transformers_and_llm_engine(core):
    outs = core.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = [o["token_ids"] for o in outs]
    assert ids == hf_greedy(tiny_model_path(), [core.tokenizer.encode(p) for p in PROMPTS], GREEDY.max_tokens)
    full = LLMEngine(tiny_model_path(), **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids == [o["token_ids"] for o in full]
    assert [o["text"] for o in outs] == [o["text"] for o in full]
    assert set(outs[0]) == {"text", "token_ids", "finish_reason", "num_cached_tokens", "prompt_token_ids"}


def test_core_seeded_sampling_is_reproducible(core):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=3, max_tokens=8)
    first, again = (core.generate(PROMPTS, params, use_tqdm=False) for _ in range(2))
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]


@pytest.mark.parametrize("asked", FEATURES, ids=[next(iter(f)) for f in FEATURES])
def test_core_refuses_what_only_llm_engine_does_before_any_work(core, asked):
    name = next(iter(asked))
    with pytest.raises(ValueError, match=f"asks for {name}=.*EngineCore does not do.*LLMEngine"):
        core.generate(["Return the", "Create a new"], SamplingParams(temperature=0, **asked), use_tqdm=False)
    assert core.is_finished() and core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert core.generate(["Return the"], GREEDY, use_tqdm=False)[0]["finish_reason"] in ("stop", "length")


def test_requested_features_names_only_what_is_asked():
    assert requested_features(SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=9, ignore_eos=True)) == []
    assert requested_features(SamplingParams(min_p=0.2, n=3)) == ["min_p=0.2", "n=3"]


def test_a_runner_without_features_refuses_them():
    runner = ModelRunner(Config(tiny_model_path(), **SMALL))
    assert type(runner.features) is NoFeatures
    seq = Sequence([1, 2, 3], SamplingParams(logprobs=2), 16)
    with pytest.raises(ValueError, match="logprobs=2.*features=RequestFeatures"):
        runner.prepare_sample([seq])
    with_features = ModelRunner(Config(tiny_model_path(), **SMALL), features=RequestFeatures)
    assert with_features.prepare_sample([seq]).logprob_k == 2


def test_llm_engine_refuses_a_runner_without_request_features():
    class Plain(LLMEngine):
        make_runner = ModelRunner

    with pytest.raises(TypeError, match="without request features"):
        Plain(tiny_model_path(), **SMALL)


def test_llm_engine_hooks_give_the_features(core):
    engine = LLMEngine(tiny_model_path(), **SMALL)
    out = engine.generate(["Return the"], SamplingParams(temperature=0, max_tokens=6, logprobs=1, n=2), use_tqdm=False)[0]
    assert len(out["outputs"]) == 2 and len(out["logprobs"]) == len(out["token_ids"])
    assert out["metrics"]["first_token_time"] is not None
    engine.add_request("Return the", SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3))
    engine.step()
    assert engine.model_runner.features.token_counts.row_of  # a penalty row is held while it runs ...
    engine.abort_all()
    assert not engine.model_runner.features.token_counts.row_of  # ... and given back on abort
    assert torch.is_tensor(engine.model_runner.features.token_counts.counts)
