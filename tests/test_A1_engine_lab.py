"""Appendix A1: the engine lab checker (notebook 08's `LLMEngine`) passes the course's engine and names the
right check for realistic broken ones."""
from lab_helpers import failed_names

from nanovllm_edu.assets import tiny_model_path
from nanovllm_edu.engine.llm_engine import LLMEngine
from nanovllm_edu.engine.model_runner import ModelRunner
from nanovllm_edu.labs.engine_checks import BASE, check_engine, lab_prompts
from nanovllm_edu.sampling_params import SamplingParams

DEFAULT = "greedy tokens equal transformers' (one prefill, then decodes)"
CHUNKED = "chunked prefill does not change the tokens"
PREEMPT = "preemption does not change the tokens"
BIG_BLOCKS = "a large block size does not change the tokens"


def test_our_engine_passes():
    report = check_engine(lambda **args: LLMEngine(tiny_model_path(), **args))
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [DEFAULT, CHUNKED, PREEMPT, BIG_BLOCKS]
    assert report.stage == "engine (08)"


def test_the_preemption_case_preempts():
    engine = LLMEngine(tiny_model_path(), **(BASE | dict(num_kvcache_blocks=7)))
    engine.generate(lab_prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0


# --- deliberately broken engines ---------------------------------------------------------------------

class LaterChunkFirstRow(ModelRunner):
    """Samples a prompt that completes in a later chunk (or a recompute) from its chunk's first row, not its last:
    the wrong row of logits, right whenever a prompt arrives whole."""

    def prepare_prefill(self, seqs):
        step = super().prepare_prefill(seqs)
        rows, k = step.logits_indices.tolist(), 0
        for i, seq in enumerate(seqs):
            if seq.num_computed_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                if seq.num_computed_tokens > 0:
                    rows[k] = int(step.cu_seqlens_q[i])
                k += 1
        step.logits_indices = step.logits_indices.new_tensor(rows)
        return step


class WrongRowEngine(LLMEngine):
    def make_runner(self):
        return LaterChunkFirstRow(self.config)


class PromptOnlyRecompute(ModelRunner):
    """Builds a prefill's input ids from the prompt only (a buffer of zeros past it): right for every first
    prefill, wrong for the recompute after a preemption, whose prefill holds the completion so far too."""

    def prepare_prefill(self, seqs):
        saved = [seq.token_ids for seq in seqs]
        for seq in seqs:
            seq.token_ids = seq.prompt_token_ids + [0] * seq.num_completion_tokens
        try:
            return super().prepare_prefill(seqs)
        finally:
            for seq, ids in zip(seqs, saved):
                seq.token_ids = ids


class NoRecomputeEngine(LLMEngine):
    def make_runner(self):
        return PromptOnlyRecompute(self.config)


def test_wrong_logits_row_fails_chunked_prefill():
    report = check_engine(lambda **args: WrongRowEngine(tiny_model_path(), **args))
    assert not report.passed
    assert CHUNKED in failed_names(report) and DEFAULT not in failed_names(report), str(report)
    assert "last row" in str(report)  # the hint


def test_no_recompute_after_preemption_fails_preemption():
    report = check_engine(lambda **args: NoRecomputeEngine(tiny_model_path(), **args))
    assert failed_names(report) == {PREEMPT}, str(report)
    assert "recomputed from token 0" in str(report)
