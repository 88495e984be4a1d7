"""Appendix A1: the async-scheduling lab checker (notebook 13's `Scheduler`) passes the course's scheduler
and names the right check for realistic broken ones."""
from itertools import islice

from lab_helpers import failed_names

from nanovllm_edu.engine.scheduler import Scheduler
from nanovllm_edu.labs.async_checks import check_async_scheduling

PLANS = "a decode is planned before the previous step's tokens are known"
OLDEST = "commit fills the oldest placeholder first"
IN_ORDER = "two steps in flight end as one step at a time"
EOS_DROPS = "an EOS at commit drops the step planned past it"
WAITING = "nothing is planned ahead while a request waits"
HALF = "planning ahead waits for the last chunk of a prompt"
BLOCKS = "a decode is planned ahead exactly when the free blocks cover it"
NOBODY = "nothing is planned ahead when nobody runs"


def test_our_async_scheduler_passes():
    report = check_async_scheduling(Scheduler)
    assert report.passed is True, str(report)
    assert len(report.checks) >= 5
    assert report.stage == "async scheduling (12)"
    assert "✗" not in str(report) and str(report).count("✓") == len(report.checks)


# --- deliberately broken implementations -------------------------------------------------------------

class NewestPlaceholderCommit(Scheduler):
    """Commit writes each token into the sequence's newest placeholder (the one-step-at-a-time habit of
    'the last token'), which with a step planned ahead is the next step's, not this one's."""

    def commit(self, pending, token_ids):
        return super().commit([(seq, seq.num_tokens - 1) for seq, _ in pending], token_ids)


class HalfPrefillAheadScheduler(Scheduler):
    """Plans ahead while a prompt is half prefilled: forgets `self.prefilling`."""

    def can_schedule_ahead(self):
        if self.waiting or not self.running:
            return False
        bm, limit = self.block_manager, min(self.max_num_seqs, self.max_num_batched_tokens)
        return sum(bm.num_missing_blocks(seq) for seq in islice(self.running, limit)) <= bm.num_free_blocks


class BlockBlindAheadScheduler(Scheduler):
    """Plans a decode ahead without asking whether the free blocks cover it (it may have to preempt)."""

    def can_schedule_ahead(self):
        return not self.waiting and self.prefilling is None and bool(self.running)


class StopKeepsPlannedToken(Scheduler):
    """An EOS at commit finishes the sequence but leaves the placeholder of the step planned past it, so the
    void token of that step is written in later."""

    def stop(self, seq, index):
        if seq.is_finished:  # already finished by length at reserve
            seq.finish_reason = "stop"
        else:
            self._finish(seq, "stop")


def test_commit_filling_the_newest_placeholder_fails_the_commit_checks():
    report = check_async_scheduling(NewestPlaceholderCommit)
    failed = failed_names(report)
    assert failed == {OLDEST, IN_ORDER, EOS_DROPS}, str(report)
    text = str(report)
    assert f"✗ {OLDEST}" in text and "hint: fill the index reserve returned" in text
    assert "what happened: step n's token 41 must fill the older of the two placeholders" in text


def test_planning_ahead_mid_prefill_fails_only_the_prefill_rule():
    report = check_async_scheduling(HalfPrefillAheadScheduler)
    assert failed_names(report) == {HALF}, str(report)
    text = str(report)
    assert f"✗ {HALF}" in text and "hint: return False while self.prefilling is not None" in text
    assert "said yes after chunk 1 of 3 of a prompt" in text


def test_planning_ahead_blind_to_free_blocks_fails_only_the_preemption_rule():
    report = check_async_scheduling(BlockBlindAheadScheduler)
    assert failed_names(report) == {BLOCKS}, str(report)
    assert "hint: sum block_manager.num_missing_blocks" in str(report)
    assert "needs 2 new blocks with 1 free" in str(report)


def test_stop_keeping_the_planned_placeholder_fails_only_the_eos_check():
    report = check_async_scheduling(StopKeepsPlannedToken)
    assert failed_names(report) == {EOS_DROPS}, str(report)
    text = str(report)
    assert f"✗ {EOS_DROPS}" in text and "hint: on EOS call stop(seq, index): delete the placeholders" in text
    assert "completion [0, -1]" in text


def test_a_stub_fails_every_check_without_raising():
    class Stub(Scheduler):
        def can_schedule_ahead(self):
            raise NotImplementedError("Exercise: implement Stub.can_schedule_ahead (see the markdown above)")

    report = check_async_scheduling(Stub)
    assert not any(c.passed for c in report.checks)
    assert all(c.detail.startswith("NotImplementedError: Exercise") for c in report.checks)


def test_never_planning_ahead_is_safe_but_not_async():
    """Always refusing never changes what is generated, but it is no async scheduling: the checks that need
    a step planned ahead fail, and the rules that say 'no' pass."""
    class NeverAhead(Scheduler):
        def can_schedule_ahead(self):
            return False

    report = check_async_scheduling(NeverAhead)
    assert failed_names(report) == {PLANS, OLDEST, IN_ORDER, EOS_DROPS, HALF, BLOCKS}, str(report)
    assert "said no to a decode once the last chunk of the prompt is in flight" in str(report)
