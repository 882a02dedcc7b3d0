"""The device pool's retention priorities: lowest priority evicted first, LRU within a priority,
durations falling back to the default; unit tests and a hypothesis state machine against a plain
reference model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvhive.core.retention import DEFAULT_PRIORITY, DEFAULT_RETENTION, PINNED_PRIORITY, BlockRetention
from kvhive.kv.pool import BlockPool, KVBlock, PriorityChange


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cached_pool(n: int, clock: Clock | None = None) -> tuple[BlockPool, list[KVBlock]]:
    """A pool of ``n`` usable blocks, all allocated and cached under h(block id)."""
    pool = BlockPool(n + 1, clock or Clock())
    blocks = pool.get_new_blocks(n)
    for b in blocks:
        assert pool.cache_block(b, h(b.block_id))
    return pool, blocks


def test_lowest_priority_is_evicted_first_then_lru():
    pool, (a, b, c, d) = cached_pool(4)
    pool.free_blocks([a], [BlockRetention(80)])
    pool.free_blocks([b], [BlockRetention(10)])
    pool.free_blocks([c], [DEFAULT_RETENTION])
    pool.free_blocks([d], [BlockRetention(10)])
    pool.check_integrity()
    assert ids(pool.free_queue) == ids([b, d, c, a])
    assert ids(pool.get_new_blocks(3)) == ids([b, d, c])
    assert pool.get_cached_block(h(a.block_id)) is a
    pool.check_integrity()


def test_empty_blocks_go_before_any_cached_block():
    pool = BlockPool(4, Clock())
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, h(1))
    pool.free_blocks([a], [BlockRetention(0)])          # the lowest priority, but it holds something
    pool.free_blocks([b, c], [BlockRetention(90)] * 2)  # nothing reusable: empty, no retention
    assert not b.retained and b.priority == DEFAULT_PRIORITY
    assert ids(pool.get_new_blocks(3)) == ids([c, b, a])
    pool.check_integrity()


def test_all_default_priority_is_plain_lru():
    pool, blocks = cached_pool(5)
    order = [blocks[i] for i in (3, 0, 4, 1, 2)]
    for b in order:
        pool.free_blocks([b], [DEFAULT_RETENTION])
    assert ids(pool.free_queue) == ids(order)
    pool.touch([order[1]])
    pool.free_blocks([order[1]], [DEFAULT_RETENTION])
    assert ids(pool.free_queue) == ids(order[:1] + order[2:] + order[1:2])


def test_a_one_off_hit_never_demotes_a_pinned_block():
    clock = Clock()
    pool, (a, b) = cached_pool(2, clock)
    pool.free_blocks([a], [BlockRetention(PINNED_PRIORITY, 60.0)])
    pool.free_blocks([b], [DEFAULT_RETENTION])
    pool.touch([a])                                      # a one-off request hits the pinned prefix
    pool.free_blocks([a], [DEFAULT_RETENTION])
    assert (a.priority, a.expiry) == (PINNED_PRIORITY, 160.0)
    assert ids(pool.free_queue) == ids([b, a])
    pool.touch([a])                                      # a longer pin at the same priority extends it
    pool.free_blocks([a], [BlockRetention(PINNED_PRIORITY, 120.0)])
    assert a.expiry == 220.0
    pool.touch([a])                                      # a shorter one does not shorten it
    pool.free_blocks([a], [BlockRetention(PINNED_PRIORITY, 1.0)])
    assert a.expiry == 220.0
    pool.check_integrity()


def test_a_low_priority_applies_to_a_block_nobody_gave_one():
    pool, (a, b) = cached_pool(2)
    pool.free_blocks([a], [BlockRetention(5)])
    assert a.priority == 5
    pool.touch([a])
    pool.free_blocks([a], [DEFAULT_RETENTION])           # someone else's request counts as the default
    assert a.priority == DEFAULT_PRIORITY
    pool.free_blocks([b])                                 # no opinion: keeps what it has (none)
    assert not b.retained and b.priority == DEFAULT_PRIORITY


def test_an_expired_priority_falls_back_to_the_head_of_the_default_level():
    clock = Clock()
    pool, (a, b, c, d) = cached_pool(4, clock)
    pool.free_blocks([b], [DEFAULT_RETENTION])
    pool.free_blocks([a], [BlockRetention(90, 10.0)])
    pool.free_blocks([c], [DEFAULT_RETENTION])
    pool.free_blocks([d], [BlockRetention(10)])
    assert ids(pool.free_queue) == ids([d, b, c, a])
    clock.now += 9.9
    assert pool.expire() == 0
    clock.now += 0.2
    assert ids(pool.free_queue) == ids([d, b, c, a])     # lazily: nothing moved yet
    assert pool.expire() == 1
    assert (a.priority, a.expiry, a.retained) == (DEFAULT_PRIORITY, None, False)
    assert ids(pool.free_queue) == ids([d, a, b, c])
    pool.check_integrity()


def test_expiry_is_checked_on_allocation_and_while_held():
    clock = Clock()
    pool, (a, b) = cached_pool(2, clock)
    pool.free_blocks([a], [BlockRetention(90, 5.0)])
    pool.free_blocks([b], [BlockRetention(95, 5.0)])
    pool.touch([b])                                      # held when its retention ends
    clock.now += 6
    (x,) = pool.get_new_blocks(1)                         # a fell back first, so it goes
    assert x is a and b.priority == DEFAULT_PRIORITY and b.ref_cnt == 1
    pool.check_integrity()


def test_an_expired_but_unprocessed_retention_is_not_live_when_freed():
    clock = Clock()
    pool, (a,) = cached_pool(1, clock)
    pool.free_blocks([a], [BlockRetention(90, 5.0)])
    pool.touch([a])
    clock.now += 10
    pool.free_blocks([a], [BlockRetention(20)])          # the 90 ended: the freer's 20 applies
    assert (a.priority, a.expiry) == (20, None)
    pool.check_integrity()


def test_set_retention_withdraws_a_pin():
    pool, (a, b, c) = cached_pool(3)
    pool.free_blocks([a], [BlockRetention(PINNED_PRIORITY)])
    pool.free_blocks([b, c], [DEFAULT_RETENTION] * 2)
    assert pool.set_retention([a]) == 1
    assert ids(pool.free_queue) == ids([a, b, c]) and not a.retained
    assert pool.set_retention([a]) == 0
    pool.check_integrity()


def test_priority_changes_of_cached_blocks_are_recorded():
    clock = Clock()
    pool, (a, b) = cached_pool(2, clock)
    pool.priority_changes = []
    pool.free_blocks([a, b], [BlockRetention(70, 1.0), DEFAULT_RETENTION])
    clock.now += 2
    pool.expire()
    assert pool.priority_changes == [PriorityChange(h(a.block_id), DEFAULT_PRIORITY, 70),
                                     PriorityChange(h(a.block_id), 70, DEFAULT_PRIORITY)]


def test_reset_and_eviction_clear_the_retention():
    pool, (a, b) = cached_pool(2)
    pool.free_blocks([a, b], [BlockRetention(70, 30.0), BlockRetention(60)])
    assert pool.reset_prefix_cache() == 2
    assert not a.retained and not b.retained and a.expiry is None
    pool.check_integrity()


def test_the_expiry_heap_stays_bounded():
    clock = Clock()
    pool, (a,) = cached_pool(1, clock)
    for i in range(200):
        pool.free_blocks([a], [BlockRetention(50 + i % 40, 1000.0 + i)])
        pool.touch([a])
        pool.check_integrity()                           # includes the heap's bound


# ---------------------------------------------------------------- the state machine

PRIORITIES = (0, 10, DEFAULT_PRIORITY, 60, PINNED_PRIORITY, 100)
DURATIONS = (None, 1.0, 3.0)


class PriorityPoolMachine(RuleBasedStateMachine):
    """Allocate / free with retentions / cache / hit / expire against a plain model of the order."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = BlockPool(9, self.clock)
        self.owners: list[list[KVBlock]] = []
        self.ref = {i: 0 for i in range(1, 9)}
        self.hashed: dict[int, bytes] = {}                  # block id -> its hash
        # Retention per block: (priority, expiry, retained).
        self.ret = {i: (DEFAULT_PRIORITY, None, False) for i in range(1, 9)}
        self.empty: list[int] = list(range(1, 9))          # head first
        self.evictable: dict[int, int] = {}                 # block id -> LRU key within its level
        self.tail_key = 0
        self.head_key = 0

    # ---- the model's queue

    def model_order(self) -> list[int]:
        ranked = sorted(self.evictable, key=lambda b: (self.ret[b][0], self.evictable[b]))
        return self.empty + ranked

    def _push(self, bid: int, first: bool = False) -> None:
        if bid not in self.hashed:
            self.empty.insert(0, bid)
        elif first:
            self.head_key -= 1
            self.evictable[bid] = self.head_key
        else:
            self.tail_key += 1
            self.evictable[bid] = self.tail_key

    def _unqueue(self, bid: int) -> None:
        if bid in self.evictable:
            del self.evictable[bid]
        else:
            self.empty.remove(bid)

    def _expire(self) -> None:
        now = self.clock.now
        due = sorted((e, b) for b, (_, e, _) in self.ret.items() if e is not None and e <= now)
        for _, bid in due:
            self._fall_back(bid)

    def _fall_back(self, bid: int) -> None:
        """No retention any more: a queued block moves to the head of the default level."""
        queued = self.ref[bid] == 0
        if queued:
            self._unqueue(bid)
        self.ret[bid] = (DEFAULT_PRIORITY, None, False)
        if queued:
            self._push(bid, first=True)

    def _retain(self, bid: int, retention: BlockRetention) -> None:
        if bid not in self.hashed:
            return
        now = self.clock.now
        p = retention.priority
        e = None if retention.duration_s is None or p == DEFAULT_PRIORITY else now + retention.duration_s
        prio, exp, retained = self.ret[bid]
        if retained and (exp is None or exp > now):
            if prio > p or (prio == p and (exp is None or (e is not None and exp >= e))):
                return
        self.ret[bid] = (p, e, True)

    # ---- rules

    @rule(n=st.integers(1, 3))
    def allocate(self, n: int) -> None:
        if n > len(self.empty) + len(self.evictable):
            return
        self._expire()
        expected = self.model_order()[:n]
        got = self.pool.get_new_blocks(n)
        assert ids(got) == expected
        for bid in expected:
            self._unqueue(bid)
            self.hashed.pop(bid, None)
            self.ret[bid] = (DEFAULT_PRIORITY, None, False)
            self.ref[bid] = 1
        self.owners.append(got)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), priority=st.sampled_from(PRIORITIES), duration=st.sampled_from(DURATIONS),
          opinion=st.booleans())
    def free(self, data, priority: int, duration: float | None, opinion: bool) -> None:
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        retention = BlockRetention(priority, duration)
        self.pool.free_blocks(reversed(owner), [retention] * len(owner) if opinion else None)
        for blk in reversed(owner):
            bid = blk.block_id
            if opinion:
                self._retain(bid, retention)
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self._push(bid)

    @precondition(lambda self: self.owners)
    @rule(data=st.data(), key=st.integers(0, 5))
    def cache(self, data, key: int) -> None:
        blk = data.draw(st.sampled_from(data.draw(st.sampled_from(self.owners))))
        ok = self.pool.cache_block(blk, h(key))
        if blk.block_id not in self.hashed:
            assert ok == (h(key) not in self.hashed.values())
            if ok:
                self.hashed[blk.block_id] = h(key)

    @rule(key=st.integers(0, 5))
    def hit(self, key: int) -> None:
        blk = self.pool.get_cached_block(h(key))
        assert (blk is None) == (h(key) not in self.hashed.values())
        if blk is None:
            return
        self.pool.touch([blk])
        if self.ref[blk.block_id] == 0:
            self._unqueue(blk.block_id)
        self.ref[blk.block_id] += 1
        self.owners.append([blk])

    @rule(dt=st.sampled_from((0.5, 1.0, 2.5)))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def expire(self) -> None:
        self.pool.expire()
        self._expire()

    @rule(key=st.integers(0, 5))
    def withdraw(self, key: int) -> None:
        blk = self.pool.get_cached_block(h(key))
        if blk is None:
            return
        bid = blk.block_id
        changed = self.pool.set_retention([blk])
        assert changed == ((self.ret[bid][0], self.ret[bid][1]) != (DEFAULT_PRIORITY, None))
        if changed:
            self._fall_back(bid)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_integrity()
        assert ids(self.pool.free_queue) == self.model_order()
        for bid, (priority, expiry, retained) in self.ret.items():
            b = self.pool.blocks[bid]
            assert (b.priority, b.expiry, b.retained) == (priority, expiry, retained)
            assert b.ref_cnt == self.ref[bid]

    @invariant()
    def next_evicted_is_the_lowest_priority_least_recently_freed(self) -> None:
        order = self.model_order()
        if self.empty or not order:
            return
        victim = order[0]
        assert all((self.ret[victim][0], self.evictable[victim]) <= (self.ret[b][0], self.evictable[b])
                   for b in self.evictable)


TestPriorityPoolMachine = PriorityPoolMachine.TestCase
TestPriorityPoolMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
