"""Appendix A1: the prepare_prefill lab checker (notebook 07's `ModelRunner.prepare_prefill` after a prefix-cache
hit) passes the package's runner and names the right check for realistic broken versions."""
import numpy as np
import torch
from lab_helpers import failed_names

from nanovllm_edu.engine.model_runner import ModelRunner, block_table_array
from nanovllm_edu.labs import check_prepare_prefill
from nanovllm_edu.utils.step_inputs import StepInputs

PLAIN = "a prefill with nothing cached"
TOKENS = "input_ids and positions: the uncached chunk only"
SLOTS = "slot_mapping: a slot for each new token only"
CU = "cu_seqlens_q counts new tokens, cu_seqlens_k whole contexts"
TABLES = "block tables when a context is cached"
LOGITS = "logits only for prompts that complete"


def test_our_runner_passes():
    report = check_prepare_prefill(ModelRunner.prepare_prefill)
    assert report.passed is True, str(report)
    assert [c.name for c in report.checks] == [PLAIN, TOKENS, SLOTS, CU, TABLES, LOGITS]
    assert report.stage == "prefill with a cached prefix (07)"


# --- a learner's version, with one part swapped for a broken one ---------------------------------------

def learner_prepare(start=lambda seq: seq.num_computed_tokens, pos_from=lambda seq, start: start,
                    slots_from=lambda seq, start: start, k_len=lambda seq, start, end: end,
                    tables=lambda seqs: any(s.num_computed_tokens > 0 for s in seqs)):
    """prepare_prefill written from scratch with plain lists; each argument is one decision a learner makes."""
    def prepare(runner, seqs):
        bs, ids, positions, slots, logits = runner.block_size, [], [], [], []
        cu_q, cu_k = [0], [0]
        for seq in seqs:
            first = start(seq)
            end = seq.num_computed_tokens + seq.num_scheduled_tokens
            ids += seq.token_ids[first:end]
            positions += list(range(pos_from(seq, first), pos_from(seq, first) + end - first))
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(slots_from(seq, first), end)]
            cu_q.append(cu_q[-1] + end - first)
            cu_k.append(cu_k[-1] + k_len(seq, first, end))
            if end == seq.num_tokens:
                logits.append(cu_q[-1] - 1)
        lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
        return StepInputs(True, torch.tensor(ids), torch.tensor(positions), torch.tensor(slots),
                          block_tables=torch.from_numpy(block_table_array(seqs)) if tables(seqs) else None,
                          cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                          cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_q=int(lens_q.max()),
                          max_seqlen_k=int(lens_k.max()), logits_indices=torch.tensor(logits, dtype=torch.int64))
    return prepare


def test_a_learner_version_passes():
    assert check_prepare_prefill(learner_prepare()).passed


def test_positions_restarting_at_zero_fail_the_positions():
    """The tail's tokens are right, but their positions count from 0, as if the prompt began there (RoPE then
    rotates them as the first tokens of the sequence)."""
    report = check_prepare_prefill(learner_prepare(pos_from=lambda seq, start: 0))
    assert TOKENS in failed_names(report) and PLAIN not in failed_names(report), str(report)
    assert CU not in failed_names(report) and SLOTS not in failed_names(report), str(report)
    assert "positions [0, 1, 2" in str(report)  # what it gave


def test_slots_for_the_cached_tokens_fail_the_slot_mapping():
    """Maps a slot for every token of the context, cached ones included: more slots than rows."""
    report = check_prepare_prefill(learner_prepare(slots_from=lambda seq, start: 0))
    assert failed_names(report) == {SLOTS}, str(report)


def test_cu_seqlens_k_equal_to_q_fails_the_lengths():
    """Counts only the chunk's tokens as keys: attention would never see the cached prefix."""
    report = check_prepare_prefill(learner_prepare(k_len=lambda seq, start, end: end - start))
    assert failed_names(report) == {CU}, str(report)
    assert "num_computed_tokens + the chunk" in str(report)  # the hint


def test_starting_at_the_cache_hit_fails_a_later_chunk():
    """Starts each chunk at num_cached_tokens: right for the first chunk after a hit, wrong for the next one,
    which recomputes the earlier chunk's tokens."""
    report = check_prepare_prefill(learner_prepare(start=lambda seq: seq.num_cached_tokens))
    assert TOKENS in failed_names(report) and PLAIN not in failed_names(report), str(report)
    assert "a chunk after a cached prefix" in str(report)


def test_no_block_tables_fails_the_tables():
    report = check_prepare_prefill(learner_prepare(tables=lambda seqs: False))
    assert failed_names(report) == {TABLES}, str(report)
