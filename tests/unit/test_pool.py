"""BlockPool: free queue, ref counts, hash map, LRU eviction; unit tests and a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvhive.kv.pool import MAX_SIBLINGS_SCANNED, NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_free_queue_o1_operations():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])                 # middle
    q.remove(blocks[0])                 # head
    q.remove(blocks[4])                 # tail
    assert ids(q) == [1, 3] and len(q) == 2
    q.appendleft(blocks[0])
    q.append(blocks[4])
    assert ids(q) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    assert ids(q) == [1, 3, 4]
    for b in list(q):
        q.remove(b)
    assert len(q) == 0 and ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()
    q.append(blocks[2])
    assert ids(q) == [2]


def test_null_block_reserved_and_stats():
    pool = BlockPool(5)
    assert pool.null_block.block_id == NULL_BLOCK_ID
    s = pool.stats()
    assert (s.num_blocks, s.num_free, s.num_cached, s.num_used, s.usage) == (4, 4, 0, 0, 0.0)
    got = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in ids(got)
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.stats().usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(1)


def test_cached_block_survives_free_and_is_revived_by_touch():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, h(1)) and pool.cache_block(b, h(2))
    pool.free_blocks([b, a])            # tail first
    pool.check_integrity()
    assert pool.stats().num_free == 2 and pool.stats().num_cached == 2
    assert pool.get_cached_block(h(1)) is a
    pool.touch([a])                     # revived from the middle of the queue
    assert a.ref_cnt == 1 and ids(pool.free_queue) == [b.block_id]
    pool.touch([a])                     # shared by a second owner
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and a.block_id not in ids(pool.free_queue)
    pool.check_integrity()


def test_eviction_is_lru_and_drops_the_hash():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    for i, blk in enumerate((a, b, c)):
        pool.cache_block(blk, h(i))
    pool.free_blocks([c, b, a])          # chain a->b->c freed tail first
    (x,) = pool.get_new_blocks(1)
    assert x is c and c.block_hash is None and pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(0)) is a
    pool.check_integrity()


def test_unhashed_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, h(7))
    pool.free_blocks([a])
    pool.free_blocks([c, b])             # no hash: go to the head
    assert ids(pool.get_new_blocks(2)) == [b.block_id, c.block_id]
    assert pool.get_cached_block(h(7)) is a
    pool.check_integrity()


def test_duplicate_hash_keeps_one_mapping():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, h(5))
    assert not pool.cache_block(b, h(5))
    assert b.block_hash is None and pool.get_cached_block(h(5)) is a
    assert pool.cache_block(a, h(5))     # idempotent
    pool.free_blocks([b, a])
    pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])


def test_cached_blocks_are_listed_under_their_parent_until_evicted_or_reset():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, h(1), h(0), [1, 2, 3, 4])
    assert pool.cache_block(b, h(2), h(0), [1, 2, 9, 9])
    assert pool.cache_block(c, h(3))                       # a first block: no parent, not listed
    assert pool.longest_child(h(0), [1, 2, 3, 7]) == (a, 3)
    assert pool.longest_child(h(0), [1, 2, 9]) == (b, 3)
    assert pool.longest_child(h(0), [5, 2, 3]) == (None, 0)
    assert pool.longest_child(h(9), [1, 2, 3]) == (None, 0)
    pool.free_blocks([a, b, c])                            # evictable: still listed
    assert pool.longest_child(h(0), [1, 2, 3]) == (a, 3)
    pool.check_integrity()
    pool.get_new_blocks(3)                                 # the two empty blocks, then a: evicted
    assert a.block_hash is None and a.parent_hash is None and a.token_ids is None
    assert pool.longest_child(h(0), [1, 2, 3]) == (b, 2)
    pool.check_integrity()
    pool.reset_prefix_cache()
    assert pool.children == {} and pool.longest_child(h(0), [1, 2]) == (None, 0)
    pool.check_integrity()


def test_a_listed_partial_block_is_evictable_and_a_source_until_handed_out():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.list_partial(a, h(0), [7, 8])
    with pytest.raises(ValueError):
        pool.list_partial(a, h(0), [7, 8])                 # listed already
    assert not pool.cache_block(a, h(1))                   # a partial never gets a hash
    pool.free_blocks([a, b])
    assert ids(pool.free_queue) == [b.block_id, 3, a.block_id]     # b empty: head; a reusable: tail
    assert pool.stats().num_evictable == 1 and pool.longest_child(h(0), [7, 8, 9]) == (a, 2)
    pool.touch([a])                                        # pinned as a copy source
    assert pool.stats().num_evictable == 0
    pool.free_blocks([a])
    assert pool.stats().num_evictable == 1
    pool.check_integrity()
    pool.get_new_blocks(3)
    assert a.parent_hash is None and pool.children == {} and pool.evicted_hashes is None
    pool.check_integrity()


def test_reset_forgets_listed_partial_blocks():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.list_partial(a, h(0), [1])
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 1 and pool.children == {}
    assert pool.stats().num_evictable == 0
    pool.check_integrity()


def test_longest_child_compares_the_most_recent_siblings_only():
    n = MAX_SIBLINGS_SCANNED + 2
    pool = BlockPool(n + 1)
    blocks = pool.get_new_blocks(n)
    for i, block in enumerate(blocks):
        assert pool.cache_block(block, h(100 + i), h(0), [i, 0, 0, 0])
    assert pool.longest_child(h(0), [n - 1, 0]) == (blocks[-1], 2)
    assert pool.longest_child(h(0), [0, 0]) == (None, 0)   # the oldest sibling is past the scan
    pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / free / cache / touch / evict against a plain-Python model of the pool."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(9)
        self.owners: list[list[KVBlock]] = []      # each owner holds one reference per block
        self.model_queue: list[int] = ids(self.pool.free_queue)
        self.model_map: dict[bytes, int] = {}
        self.model_listed: set[int] = set()           # listed partial blocks
        self.model_ref = {i: 0 for i in range(1, 9)}

    def _reusable(self, bid: int) -> bool:
        return bid in self.model_map.values() or bid in self.model_listed

    def _allocate(self, n: int) -> None:
        got = self.pool.get_new_blocks(n)
        expected, self.model_queue = self.model_queue[:n], self.model_queue[n:]
        assert ids(got) == expected
        for bid in expected:
            self.model_map = {k: v for k, v in self.model_map.items() if v != bid}
            self.model_listed.discard(bid)
            self.model_ref[bid] = 1
        self.owners.append(got)

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n <= len(self.model_queue):
            self._allocate(n)
        else:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)

    @precondition(lambda self: any(self._reusable(bid) for bid in self.model_queue))
    @rule()
    def evict(self) -> None:
        # Allocate up to and including the first reusable block in the queue: it must lose its
        # hash or listing.
        pos = next(i for i, bid in enumerate(self.model_queue) if self._reusable(bid))
        victim = self.model_queue[pos]
        self._allocate(pos + 1)
        assert self.pool.blocks[victim].block_hash is None and self.pool.blocks[victim].parent_hash is None
        assert not self._reusable(victim)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data) -> None:
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.free_blocks(reversed(owner))
        head: list[int] = []
        for blk in reversed(owner):
            self.model_ref[blk.block_id] -= 1
            if self.model_ref[blk.block_id] == 0:
                if self._reusable(blk.block_id):
                    self.model_queue.append(blk.block_id)
                else:
                    head.insert(0, blk.block_id)
        self.model_queue = head + self.model_queue

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), key=st.integers(0, 5))
    def cache(self, data, key: int) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        blk = data.draw(st.sampled_from(owner))
        expected = blk.block_hash is None and h(key) not in self.model_map and blk.block_id not in self.model_listed
        had = blk.block_hash
        ok = self.pool.cache_block(blk, h(key))
        if had is None:
            assert ok == expected
            if ok:
                self.model_map[h(key)] = blk.block_id

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), key=st.integers(0, 5), parent=st.integers(6, 7), first=st.integers(0, 2))
    def cache_child(self, data, key: int, parent: int, first: int) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        blk = data.draw(st.sampled_from(owner))
        had = blk.block_hash
        ok = self.pool.cache_block(blk, h(key), h(parent), [first, key])
        assert not (ok and blk.block_id in self.model_listed)
        if had is None and ok:
            self.model_map[h(key)] = blk.block_id
            assert self.pool.longest_child(h(parent), [first, key]) == (blk, 2)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), parent=st.integers(6, 7))
    def list_partial(self, data, parent: int) -> None:
        blk = data.draw(st.sampled_from(data.draw(st.sampled_from(self.owners))))
        if blk.block_hash is not None or blk.block_id in self.model_listed:
            with pytest.raises(ValueError):
                self.pool.list_partial(blk, h(parent), [9])
            return
        self.pool.list_partial(blk, h(parent), [9])
        self.model_listed.add(blk.block_id)

    @rule(key=st.integers(0, 5))
    def touch(self, key: int) -> None:
        blk = self.pool.get_cached_block(h(key))
        assert (blk is None) == (h(key) not in self.model_map)
        if blk is None:
            return
        self.pool.touch([blk])
        if self.model_ref[blk.block_id] == 0:
            self.model_queue.remove(blk.block_id)
        self.model_ref[blk.block_id] += 1
        self.owners.append([blk])

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert ids(self.pool.free_queue) == self.model_queue
        assert {k: b.block_id for k, b in self.pool.cached.items()} == self.model_map
        assert all(self.pool.blocks[i].ref_cnt == r for i, r in self.model_ref.items())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
