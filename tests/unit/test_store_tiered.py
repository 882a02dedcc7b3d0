"""TieredStore: mixed-tier longest-prefix lookup, promotion on a lower-tier hit, demotion on eviction."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvhive.store.base import PutResult, StoreStats
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def key(i: int) -> StoreKey:
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int) -> bytes:
    return (i.to_bytes(4, "little") * (BLOCK // 4 + 1))[:BLOCK]


class RecordingStore(MemoryStore):
    """A MemoryStore that records which keys each contains call asked about."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.asked: list[list[StoreKey]] = []

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        self.asked.append(list(keys))
        return super().contains(keys)


def make_tiers(tmp_path, cpu_blocks: int = 100):
    """cpu (memory) -> disk -> shared (a write-through memory store standing in for Redis)."""
    cpu = RecordingStore(cpu_blocks * BLOCK)
    disk = DiskStore(str(tmp_path), budget_bytes=10_000_000, segment_bytes=100_000)
    shared = RecordingStore(1000 * BLOCK)
    tiered = TieredStore([Tier("cpu", cpu), Tier("disk", disk), Tier("redis", shared, write_through=True)])
    return tiered, cpu, disk, shared


def where(store, indices) -> list[bool]:
    return store.contains([key(i) for i in indices])


def test_lookup_prefix_spans_mixed_tiers(tmp_path):
    tiered, cpu, disk, shared = make_tiers(tmp_path)
    cpu.put(key(0), payload(0))
    disk.put(key(1), payload(1))
    shared.put(key(2), payload(2))
    cpu.put(key(3), payload(3))
    disk.put(key(3), payload(3))
    cpu.put(key(5), payload(5))                            # after the gap: not part of the prefix
    cpu.asked.clear()
    shared.asked.clear()
    keys = [key(i) for i in range(6)]
    assert tiered.lookup_prefix(keys) == [0, 1, 2, 0]      # the highest tier that holds each block
    assert cpu.asked == [keys]                             # one batched probe per tier ...
    assert shared.asked == [[key(2), key(4)]]              # ... asking only for what is still missing
    assert tiered.lookup_prefix([]) == []
    assert tiered.lookup_prefix([key(9), key(0)]) == []


def test_put_writes_top_tier_and_write_through_tier(tmp_path):
    tiered, cpu, disk, shared = make_tiers(tmp_path)
    assert tiered.put(key(1), payload(1))
    assert [where(t, [1]) for t in (cpu, disk, shared)] == [[True], [False], [True]]
    assert tiered.put(key(2), payload(2), from_tier=1)     # skip the memory tier
    assert [where(t, [2]) for t in (cpu, disk, shared)] == [[False], [True], [True]]
    with pytest.raises(ValueError):
        tiered.put(key(3), payload(3), from_tier=3)


def test_get_promotes_a_lower_tier_hit(tmp_path):
    tiered, cpu, disk, shared = make_tiers(tmp_path)
    disk.put(key(1), payload(1))
    shared.put(key(2), payload(2))
    assert bytes(tiered.get(key(1))) == payload(1)
    assert where(cpu, [1]) == [True]
    assert bytes(tiered.get(key(2))) == payload(2)         # a Redis hit lands in cpu and disk
    assert where(cpu, [2]) == [True] and where(disk, [2]) == [True]
    assert tiered.get(key(3)) is None
    stats = tiered.stats()
    assert list(stats) == ["cpu", "disk", "redis"]
    assert (stats["cpu"].hits, stats["cpu"].misses) == (0, 3)
    assert (stats["disk"].hits, stats["redis"].hits) == (1, 1)
    assert tiered.get(key(2)) is not None and tiered.stats()["cpu"].hits == 1


def test_top_tier_evictions_are_demoted_not_dropped(tmp_path):
    tiered, cpu, disk, shared = make_tiers(tmp_path, cpu_blocks=3)
    for i in range(5):
        tiered.put(key(i), payload(i), from_tier=0)
    assert where(cpu, range(5)) == [False, False, True, True, True]
    assert where(disk, range(5)) == [True, True, False, False, False]   # the two LRU blocks moved down
    assert tiered.lookup_prefix([key(i) for i in range(5)]) == [1, 1, 0, 0, 0]
    assert bytes(tiered.get(key(0))) == payload(0)                      # promoted back up ...
    assert where(cpu, [0, 2]) == [True, False] and where(disk, [2]) == [True]   # ... evicting 2 down
    assert tiered.stats()["cpu"].evictions == 3
    for i in range(5):
        assert bytes(tiered.get(key(i))) == payload(i)


def test_no_demotion_into_a_write_through_tier(tmp_path):
    cpu = MemoryStore(2 * BLOCK)
    shared = RecordingStore(100 * BLOCK)
    tiered = TieredStore([Tier("cpu", cpu), Tier("redis", shared, write_through=True)])
    for i in range(4):
        tiered.put(key(i), payload(i))
    assert where(shared, range(4)) == [True] * 4                         # written through, once each
    assert shared.stats().bytes_in == 4 * BLOCK
    assert tiered.lookup_prefix([key(i) for i in range(4)]) == [1, 1, 0, 0]


class BrokenStore:
    """A tier whose every call fails softly, as a down Redis does."""

    def contains(self, keys):
        return [False] * len(keys)

    def get(self, key):
        return None

    def put(self, key, payload):
        return PutResult(False)

    def delete(self, key):
        pass

    def stats(self):
        return StoreStats()

    def close(self):
        pass


def test_a_failing_tier_does_not_break_the_others(tmp_path):
    cpu = MemoryStore(10 * BLOCK)
    tiered = TieredStore([Tier("cpu", cpu), Tier("redis", BrokenStore(), write_through=True)])
    assert tiered.put(key(1), payload(1))
    assert tiered.lookup_prefix([key(1), key(2)]) == [0]
    assert bytes(tiered.get(key(1))) == payload(1)


def test_delete_and_close_reach_every_tier(tmp_path):
    tiered, cpu, disk, shared = make_tiers(tmp_path)
    tiered.put(key(1), payload(1))
    tiered.put(key(1), payload(1), from_tier=1)
    tiered.delete(key(1))
    assert tiered.lookup_prefix([key(1)]) == []
    tiered.put(key(2), payload(2), from_tier=1)
    tiered.close()
    reopened = DiskStore(str(tmp_path), budget_bytes=10_000_000, segment_bytes=100_000)
    assert bytes(reopened.get(key(2))) == payload(2)
    reopened.close()


def test_tier_names_must_be_unique():
    with pytest.raises(ValueError):
        TieredStore([Tier("cpu", MemoryStore(BLOCK)), Tier("cpu", MemoryStore(BLOCK))])
    with pytest.raises(ValueError):
        TieredStore([])


def test_a_lower_tier_hit_is_promoted_into_every_tier_above(tmp_path):
    space = KeySpace("test-model", 1, "float32", 16)
    key, payload = space.key(bytes(16)), bytes(range(200)) * 5
    cpu, disk, redis = MemoryStore(1 << 20), DiskStore(str(tmp_path), 1 << 24), MemoryStore(1 << 20)
    # The layout DurableState.tiered_store makes: disk and Redis are both write-through.
    tiered = TieredStore([Tier("cpu", cpu), Tier("disk", disk, write_through=True),
                          Tier("redis", redis, write_through=True)])
    try:
        redis.put(key, payload)                     # saved by another replica
        assert bytes(tiered.get(key)) == payload
        assert cpu.contains([key]) == [True] and disk.contains([key]) == [True]
        assert bytes(disk.get(key)) == payload
    finally:
        tiered.close()
