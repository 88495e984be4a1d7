"""Notebook 08's LLMEngine, grown in place by notebooks 09 and 13: the package's one engine class generates what
transformers does, `LLM` is one thin class over it, what a request asks is applied (not ignored) and given back
when it ends, and the scheduler's batch carries its split to the runner."""
import pytest
import torch

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.llm_engine import LLMEngine
from nanovllm_edu.engine.llm_engine import requested_features
from nanovllm_edu.engine.scheduler import ScheduledBatch
from nanovllm_edu.engine.sequence import Sequence
from nanovllm_edu.llm import LLM
from nanovllm_edu.sampling_params import SamplingParams

from parity import hf_greedy

SMALL = dict(device="cpu", max_num_seqs=8, num_kvcache_blocks=32, kvcache_block_size=16)
PROMPTS = ["Return the", "Create a new", "Raise ValueError if the given"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(tiny_model_path(), **SMALL)


def test_engine_greedy_matches_transformers_and_llm(engine):
    outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = [o["token_ids"] for o in outs]
    assert ids == hf_greedy(tiny_model_path(), [engine.tokenizer.encode(p) for p in PROMPTS], GREEDY.max_tokens)
    full = LLM(tiny_model_path(), **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids == [o["token_ids"] for o in full]
    assert [o["text"] for o in outs] == [o["text"] for o in full]


def test_llm_is_one_thin_class_over_the_one_engine():
    assert LLM.__mro__ == (LLM, LLMEngine, object)
    assert set(vars(LLM)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__", "__static_attributes__"} == {"make_runner"}


def test_engine_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=3, max_tokens=8)
    first, again = (engine.generate(PROMPTS, params, use_tqdm=False) for _ in range(2))
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in again]


def test_requested_features_names_only_what_is_asked():
    assert requested_features(SamplingParams(temperature=0.5, top_k=3, seed=1, max_tokens=9, ignore_eos=True)) == []
    assert requested_features(SamplingParams(min_p=0.2, n=3)) == ["min_p=0.2", "n=3"]


def test_the_runner_applies_what_requests_ask():
    runner = LLMEngine(tiny_model_path(), **SMALL).model_runner
    seq = Sequence([1, 2, 3], SamplingParams(logprobs=2, min_p=0.1), 16)
    sampling = runner.prepare_sample([seq])
    assert sampling.logprob_k == 2 and sampling.min_ps is not None


def test_the_engine_applies_the_features_and_gives_them_back(engine):
    out = engine.generate(["Return the"], SamplingParams(temperature=0, max_tokens=6, logprobs=1, n=2), use_tqdm=False)[0]
    assert len(out["outputs"]) == 2 and len(out["logprobs"]) == len(out["token_ids"])
    assert out["metrics"]["first_token_time"] is not None
    engine.add_request("Return the", SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3))
    engine.step()
    assert engine.model_runner.token_counts.row_of  # a penalty row is held while it runs ...
    engine.abort_all()
    assert not engine.model_runner.token_counts.row_of  # ... and given back on abort
    assert torch.is_tensor(engine.model_runner.token_counts.counts)


def test_the_scheduler_splits_the_batch_once(engine):
    engine.add_request("Return the", SamplingParams(temperature=0, max_tokens=3))
    engine.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3))
    batch = engine.scheduler.schedule()
    assert isinstance(batch, ScheduledBatch) and batch.is_prefill and batch.num_decode_rows == 0
    assert batch.num_tokens == sum(seq.num_scheduled_tokens for seq in batch.seqs) and batch.sampled == batch.seqs
    seqs, is_prefill = batch  # as notebook 06's loops unpack it
    assert seqs is batch.seqs and is_prefill
    engine.scheduler.reserve(batch.seqs)
    engine.abort_all()


def test_observe_takes_an_observer_and_only_observers_get_events(engine):
    from nanovllm_edu.engine.observer import StepObserver

    with pytest.raises(TypeError, match="takes a StepObserver.*got object"):
        with engine.observe(object()):
            pass
    assert engine.observer.watches is False  # refused before anything was attached

    class Count(StepObserver):
        def __init__(self):
            self.steps = 0

        def step_finished(self, engine, seqs, is_prefill, finished):
            self.steps += 1

    assert Count.watches and not StepObserver.watches
    with engine.observe(Count()) as count:
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert count.steps == 3 and engine.observer.watches is False
