"""Notebook 05: the block manager with prefix caching on: chained hashes, hits, ref counts, revival of freed blocks,
eviction, token verification, the last-token rule, completion sharing and a property-based model check that
no sequence ever reads KV written for other tokens."""
import pytest

pytest.importorskip("hypothesis")  # the dev extra: a bare GPU machine (`pytest -m gpu`) may lack it
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanovllm_edu.engine import block_manager
from nanovllm_edu.engine.block_manager import BlockManager, compute_block_hash, make_block_manager
from nanovllm_edu.engine.sequence import Sequence

BS = 16


def seq(tokens, bs=BS):
    return Sequence(list(tokens), block_size=bs)


def test_chained_hash():
    a, b = list(range(16)), list(range(16, 32))
    assert compute_block_hash(a) == compute_block_hash(list(a))
    assert compute_block_hash(b, compute_block_hash(a)) != compute_block_hash(b)
    assert compute_block_hash(b, compute_block_hash(a)) != compute_block_hash(b, compute_block_hash(b))
    assert compute_block_hash(a) >= 0


def test_make_block_manager():
    plain = make_block_manager(4, 16, False)
    assert type(plain) is BlockManager and not plain.enable_prefix_caching
    pc = make_block_manager(4, 32)
    assert type(pc) is BlockManager and pc.enable_prefix_caching and pc.block_size == 32 and pc.num_blocks == 4
    assert not BlockManager(4, 16).enable_prefix_caching  # the class's default is off, the engine's on


def test_flag_off_is_notebook_03s_manager():
    """With the flag off nothing is hashed or shared, and the publish/withhold calls the scheduler makes
    whatever the flag do nothing."""
    bm = BlockManager(8, BS)
    a, b = seq(range(40)), seq(range(40))
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
    assert b.num_computed_tokens == 0 and not bm.can_allocate(seq(range(40)))
    bm.publish_full_blocks(a, 40)
    for _ in range(9):
        a.append_token(7)
        bm.may_append(a)
    bm.withhold_full_blocks(a, 0)
    assert bm.hash_to_block_id == {} and all(block.hash == -1 for block in bm.blocks)
    assert (bm.num_hit_blocks, bm.num_queried_blocks) == (0, 0)
    bm.check_invariants([a, b])


def test_shared_prefix_hits_and_ref_counts():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    system = list(range(1000, 1040))  # 2 full blocks + 8 tokens
    a, b = seq(system + [1, 2, 3]), seq(system + [4, 5])
    bm.allocate(a)
    assert a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    bm.allocate(b)
    assert b.num_cached_tokens == 32 and b.num_computed_tokens == 32
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_free_blocks == 10 - 3 - 1
    bm.check_invariants([a, b])
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.check_invariants([b])
    bm.deallocate(b)
    assert bm.num_free_blocks == 10
    bm.check_invariants([])


def test_never_caches_the_last_prompt_token():
    bm = BlockManager(10, BS, enable_prefix_caching=True)
    a = seq(range(32))
    bm.allocate(a)
    b = seq(range(32))  # the whole prompt is cached: the last block must still be computed
    bm.allocate(b)
    assert b.num_cached_tokens == 16 and b.num_computed_tokens == 16
    c = seq(range(33))  # both full blocks end before the last token: both hit
    bm.allocate(c)
    assert c.num_cached_tokens == 32
    bm.check_invariants([a, b, c])
    d = seq(range(16))  # a one-block prompt never hits
    bm.allocate(d)
    assert d.num_cached_tokens == 0


def test_freed_blocks_are_revived_then_evicted():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq(range(40))
    bm.allocate(a)
    old = list(a.block_table)
    bm.deallocate(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block_id) == 2
    b = seq(list(range(40)) + [9])
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == old[:2] and b.num_cached_tokens == 32  # revived from the free pool
    bm.check_invariants([b])
    bm.deallocate(b)
    # an unrelated request needing the whole pool evicts the cached blocks
    big = seq(range(5000, 5000 + 4 * BS))
    bm.allocate(big)
    assert all(bm.blocks[i].token_ids == big.block(j) for j, i in enumerate(big.block_table))
    assert set(bm.hash_to_block_id.values()) == set(big.block_table)
    bm.deallocate(big)
    c = seq(list(range(40)) + [9])
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_hash_hit_with_other_tokens_is_a_miss():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    a = seq(range(40))
    bm.allocate(a)
    bm.blocks[a.block_table[0]].token_ids = [123] * BS  # simulate a hash collision
    b = seq(range(40))
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and not set(b.block_table) & set(a.block_table)
    bm.check_invariants([a, b])


def test_miss_ends_the_prefix():
    bm = BlockManager(12, BS, enable_prefix_caching=True)
    a = seq(range(64))
    bm.allocate(a)
    b = seq([7] * 16 + list(range(16, 64)) + [1])  # block 0 differs: later blocks have other chained hashes
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_can_allocate_counts_shared_blocks_as_free():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = seq(range(48))  # 3 blocks
    bm.allocate(a)
    b = seq(list(range(48)) + [1])  # 4 blocks, 3 of them shared with a: needs only 1 free block
    assert bm.num_free_blocks == 1 and bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 48 and bm.num_free_blocks == 0
    bm.check_invariants([a, b])


def test_decode_publishes_filled_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    s = seq(range(10))
    bm.allocate(s)
    assert bm.blocks[s.block_table[0]].hash == -1  # partly filled: not findable
    for t in range(100, 124):  # to 34 tokens: blocks 0 and 1 fill
        s.append_token(t)
        bm.may_append(s)
    assert all(bm.blocks[i].hash != -1 for i in s.block_table[:2]) and bm.blocks[s.block_table[2]].hash == -1
    follow = seq(s.token_ids + [1, 2])
    bm.allocate(follow)
    assert follow.num_cached_tokens == 32 and follow.block_table[:2] == s.block_table[:2]
    bm.check_invariants([s, follow])


def test_preempted_sequence_recomputes_from_its_own_blocks_without_reporting_them():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    s = seq(range(20))
    bm.allocate(s)
    for t in range(30):
        s.append_token(t)
        bm.may_append(s)
    bm.deallocate(s)  # preemption
    assert s.num_computed_tokens == 0
    bm.allocate(s)
    assert s.num_computed_tokens == 48 and s.num_cached_tokens == 0  # 50 tokens: 3 full blocks before the last


class PrefixCacheMachine(RuleBasedStateMachine):
    """A model of the KV cache's content: the engine writes each sequence's uncomputed tokens into its slots.
    Sharing must never let a sequence see a slot holding another token, and no block may leak."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, enable_prefix_caching=True)
        self.content = {}  # slot -> token id written there
        self.live: list[Sequence] = []

    def _write(self, s, start, end):
        for p in range(start, end):
            self.content[s.block_table[p // BS] * BS + p % BS] = s.token_ids[p]

    @rule(prefix=st.sampled_from([0, 1, 2]), prefix_len=st.sampled_from([0, 16, 31, 32, 48]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def allocate(self, prefix, prefix_len, tail):
        s = seq([prefix * 100 + i for i in range(prefix_len)] + tail)
        if not self.bm.can_allocate(s):
            return
        self.bm.allocate(s)
        assert s.num_computed_tokens % BS == 0 and s.num_computed_tokens <= s.num_tokens - 1
        for p in range(s.num_computed_tokens):  # every cached token is really there
            assert self.content[s.block_table[p // BS] * BS + p % BS] == s.token_ids[p]
        self._write(s, s.num_computed_tokens, s.num_tokens)  # the prefill
        s.num_computed_tokens = s.num_tokens
        self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        s = data.draw(st.sampled_from(self.live))
        s.append_token(token)
        if self.bm.can_append(s):
            self.bm.may_append(s)
            self._write(s, s.num_tokens - 1, s.num_tokens)
        else:
            self.bm.deallocate(s)
            self.live.remove(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        s = data.draw(st.sampled_from(self.live))
        self.bm.deallocate(s)
        self.live.remove(s)

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants(self.live)
        for s in self.live:
            for p in range(s.num_tokens):
                assert self.content[s.block_table[p // BS] * BS + p % BS] == s.token_ids[p], "shared KV corrupted"
        for h, block_id in bm.hash_to_block_id.items():
            assert bm.blocks[block_id].hash == h
        for block in bm.blocks:  # a published block's recorded tokens are what its slots hold
            if block.hash != -1:
                assert [self.content.get(block.block_id * BS + o) for o in range(BS)] == block.token_ids


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


class CollidingHashMachine(PrefixCacheMachine):
    """The same model with a terrible hash (many collisions): token verification must keep it correct."""

    def __init__(self):
        super().__init__()
        self._saved = block_manager.compute_block_hash
        block_manager.compute_block_hash = lambda token_ids, prefix_hash=-1: (sum(token_ids) + max(prefix_hash, 0)) % 5

    def teardown(self):
        block_manager.compute_block_hash = self._saved


TestCollidingHashMachine = CollidingHashMachine.TestCase
TestCollidingHashMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("block_size", [16, 256])
def test_block_sizes(block_size):
    bm = make_block_manager(8, block_size, True)
    a = Sequence(list(range(3 * block_size)), block_size=block_size)
    b = Sequence(list(range(3 * block_size)) + [5], block_size=block_size)
    bm.allocate(a)
    bm.allocate(b)
    assert b.num_cached_tokens == 3 * block_size
