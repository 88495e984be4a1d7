"""Notebook 03: Sequence and the block manager's bookkeeping (property-based)."""
import pytest
import torch

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanovllm_edu.engine.block_manager import BlockManager
from nanovllm_edu.config import check_block_size
from nanovllm_edu.engine.sequence import Sequence, SequenceStatus
from nanovllm_edu.sampling_params import SamplingParams

torch.set_grad_enabled(False)


# ---------------------------------------------------------------- Sequence

def test_sequence_counts_and_blocks():
    seq = Sequence(list(range(40)), SamplingParams(max_tokens=3), block_size=16)
    assert seq.status == SequenceStatus.WAITING and seq.finish_reason is None
    assert (len(seq), seq.num_prompt_tokens, seq.num_blocks, seq.last_block_num_tokens) == (40, 40, 3, 8)
    assert seq.block(0) == list(range(16)) and seq.block(2) == list(range(32, 40))
    with pytest.raises(IndexError):
        seq.block(3)
    seq.append_token(99)
    assert seq.last_token == 99 and seq.num_completion_tokens == 1 and seq.completion_token_ids == [99]
    assert seq.prompt_token_ids == list(range(40)) and seq.num_tokens == 41


def test_sequence_copies_tokens_and_has_unique_ids():
    prompt = [1, 2, 3]
    a, b = Sequence(prompt), Sequence(prompt)
    a.append_token(4)
    assert prompt == [1, 2, 3] and a.seq_id != b.seq_id
    assert a.block_size == 256 and a.sampling_params == SamplingParams()


@pytest.mark.parametrize("bad", [0, 1, 8, 24, 100, 255, -16, 16.0])
def test_block_size_validation(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_block_size(bad)
    with pytest.raises(ValueError):
        BlockManager(4, bad)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError):
        Sequence([])


@pytest.mark.parametrize("block_size", [16, 32, 256, 1024])
def test_valid_block_sizes(block_size):
    assert BlockManager(3, block_size).block_size == block_size


# ---------------------------------------------------------------- BlockManager

def test_allocate_deallocate_roundtrip():
    bm = BlockManager(6, 16)
    a, b = Sequence(list(range(33)), block_size=16), Sequence(list(range(16)), block_size=16)
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 1 and bm.num_free_blocks == 2
    assert not set(a.block_table) & set(b.block_table)
    bm.check_invariants([a, b])
    c = Sequence(list(range(40)), block_size=16)
    assert not bm.can_allocate(c)
    with pytest.raises(RuntimeError):
        bm.allocate(c)
    bm.check_invariants([a, b])  # a failed allocate takes nothing
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 5
    bm.deallocate(a)  # second deallocate of an empty table is a no-op, not a double free
    assert bm.num_free_blocks == 5
    bm.check_invariants([b])


@pytest.mark.parametrize("num_tokens,free_after", [(40, 8 - 4), (32, 8 - 2)], ids=["partial-last-block", "full-blocks"])
def test_fork_shares_full_blocks_and_copies_the_partial_one(num_tokens, free_after):
    bm = BlockManager(num_blocks=8, block_size=16)
    parent = Sequence(list(range(num_tokens)), block_size=16)
    bm.allocate(parent)
    child = Sequence(list(range(num_tokens)), block_size=16)
    copies, complete = bm.fork(parent, child, num_tokens)
    full = num_tokens // 16
    assert complete and child.block_table[:full] == parent.block_table[:full]
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table[:full])
    if num_tokens % 16:
        assert copies == [(parent.block_table[-1], child.block_table[-1])] and child.block_table[-1] not in parent.block_table
    else:
        assert copies == [] and child.block_table == parent.block_table
    assert bm.num_free_blocks == free_after
    bm.check_invariants([parent, child])
    for seq in (child, parent):
        bm.deallocate(seq)
    assert bm.num_free_blocks == bm.num_blocks


def test_fork_without_a_free_block_says_so():
    bm = BlockManager(num_blocks=3, block_size=16)
    parent = Sequence(list(range(40)), block_size=16)
    bm.allocate(parent)
    child = Sequence(list(range(40)), block_size=16)
    assert bm.fork(parent, child, 40) == ([], False)  # the two full blocks are shared, the partial one is not
    assert child.block_table == parent.block_table[:2]
    bm.check_invariants([parent, child])


def test_freed_blocks_go_to_the_back():
    bm = BlockManager(4, 16)
    a = Sequence(list(range(20)), block_size=16)
    bm.allocate(a)
    assert a.block_table == [0, 1]
    bm.deallocate(a)
    assert list(bm.free_block_ids) == [2, 3, 1, 0]


def test_append_needs_a_block_only_when_one_starts():
    bm = BlockManager(3, 16)
    seq = Sequence(list(range(16)), block_size=16)
    bm.allocate(seq)
    seq.append_token(1)  # token 17 starts block 1
    assert bm.num_missing_blocks(seq) == 1 and bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    for _ in range(15):
        seq.append_token(1)
        assert bm.num_missing_blocks(seq) == 0
        bm.may_append(seq)
    assert len(seq.block_table) == 2
    hog = Sequence([1], block_size=16)
    bm.allocate(hog)
    seq.append_token(1)
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError):
        bm.may_append(seq)
    bm.check_invariants([seq, hog])


def test_block_size_mismatch_rejected():
    with pytest.raises(ValueError, match="block size"):
        BlockManager(4, 16).allocate(Sequence([1, 2], block_size=32))


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / deallocate sequences never leak or double-free a block."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, 16)
        self.live: list[Sequence] = []

    @rule(n=st.integers(1, 70))
    def allocate(self, n):
        seq = Sequence([7] * n, block_size=16)
        if self.bm.can_allocate(seq):
            free = self.bm.num_free_blocks
            self.bm.allocate(seq)
            assert self.bm.num_free_blocks == free - seq.num_blocks
            self.live.append(seq)
        else:
            assert self.bm.num_free_blocks < seq.num_blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append(self, data):
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(3)
        if self.bm.can_append(seq):
            self.bm.may_append(seq)
        else:  # out of blocks: behave like a preemption
            self.bm.deallocate(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def deallocate(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.deallocate(seq)
        self.live.remove(seq)

    @invariant()
    def consistent(self):
        self.bm.check_invariants(self.live)
        owned = [b for s in self.live for b in s.block_table]
        assert len(owned) == len(set(owned)), "two sequences own one block"
        assert all(len(s.block_table) == s.num_blocks for s in self.live)
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(owned)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
