"""Pins: blocks of live sessions are never dropped by the tier that keeps them (memory, disk,
tiered), shared pins are refcounted, and a full budget refuses new blocks instead."""

from __future__ import annotations

from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import Tier, TieredStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def key(i: int):
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int, size: int = BLOCK) -> bytes:
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def held(store, indices) -> list[int]:
    return [i for i, hit in zip(indices, store.contains([key(i) for i in indices]), strict=True) if hit]


# ---------------------------------------------------------------- memory tier


def test_memory_pinned_blocks_outlive_lru_eviction():
    store = MemoryStore(5 * BLOCK)
    for i in range(3):
        store.put(key(i), payload(i))
    store.pin([key(0), key(1), key(9)])            # key 9 is not stored yet: pinned when it arrives
    for i in range(10, 30):
        assert store.put(key(i), payload(i))
    assert held(store, range(3)) == [0, 1]
    assert store.put(key(9), payload(9))
    for i in range(30, 40):
        store.put(key(i), payload(i))
    assert held(store, [0, 1, 9]) == [0, 1, 9]
    assert store.get(key(0)) == payload(0)
    assert store.stats().used_bytes <= store.budget_bytes


def test_memory_full_of_pins_refuses_new_blocks_and_evicts_nothing():
    store = MemoryStore(4 * BLOCK)
    store.pin([key(i) for i in range(3)])
    for i in range(3):
        assert store.put(key(i), payload(i))
    assert store.put(key(10), payload(10))          # the one unpinned slot
    store.pin([key(3)])
    result = store.put(key(3), payload(3))          # pinned, but the budget is all taken by pins + key 10
    assert result.stored and [e.key for e in result.evicted] == [key(10)]
    refused = store.put(key(11), payload(11))
    assert not refused and refused.evicted == ()
    assert held(store, [0, 1, 2, 3, 11]) == [0, 1, 2, 3]
    store.pin([key(4)])
    assert not store.put(key(4), payload(4))        # a pinned block that does not fit is refused too
    assert store.put(key(2), payload(2))            # storing a pinned block again keeps it
    assert held(store, range(4)) == [0, 1, 2, 3]
    store.unpin([key(0), key(1)])
    assert store.put(key(12), payload(12)) and store.put(key(13), payload(13))
    assert held(store, [0, 1, 2, 3, 12, 13]) == [2, 3, 12, 13]
    assert store.stats().used_bytes == 4 * BLOCK


# ---------------------------------------------------------------- disk tier


def test_disk_pinned_records_are_carried_forward_when_their_segment_goes(tmp_path):
    store = DiskStore(str(tmp_path), budget_bytes=40 * BLOCK, segment_bytes=5 * BLOCK)
    pinned = [0, 3, 7]
    store.pin([key(i) for i in pinned])
    for i in range(10):
        assert store.put(key(i), payload(i))
    for i in range(100, 300):                       # five budgets of other blocks
        assert store.put(key(i), payload(i))
    assert store.stats().evictions > 100
    assert held(store, range(10)) == pinned
    for i in pinned:
        assert bytes(store.get(key(i))) == payload(i)
    assert store.stats().used_bytes <= store.budget_bytes
    store.unpin([key(i) for i in pinned])
    for i in range(300, 400):
        store.put(key(i), payload(i))
    assert held(store, pinned) == []
    store.close()


def test_disk_full_of_pins_refuses_unpinned_puts(tmp_path):
    store = DiskStore(str(tmp_path), budget_bytes=20 * BLOCK, segment_bytes=4 * BLOCK)
    record = BLOCK + 200                             # payload + codec header, roughly
    store.pin([key(i) for i in range(100)])
    stored = [i for i in range(100) if store.put(key(i), payload(i))]
    assert 10 <= len(stored) < 20                    # as many as fit beside each other
    assert not store.put(key(500), payload(500))
    assert held(store, range(100)) == stored         # none of the pinned ones was dropped
    for i in stored:
        assert bytes(store.get(key(i))) == payload(i)
    store.unpin([key(i) for i in stored[:5]])
    assert store.put(key(501), payload(501))         # unpinning made room
    assert store.stats().used_bytes <= store.budget_bytes + record
    store.close()


# ---------------------------------------------------------------- tiered store


def test_tiered_pins_are_refcounted_across_sessions():
    cpu = MemoryStore(4 * BLOCK)
    tiered = TieredStore([Tier("cpu", cpu)])
    assert tiered.keeper == 0
    for i in range(3):
        tiered.put(key(i), payload(i))
    tiered.pin_session("a", [key(0), key(1)])
    tiered.pin_session("b", [key(1), key(2)])        # block 1 shared
    assert tiered.pin_stats().num_blocks == 3
    tiered.unpin_session("a")
    for i in range(10, 20):
        tiered.put(key(i), payload(i))
    assert held(cpu, range(3)) == [1, 2]             # block 1 stays: session b still holds it
    tiered.pin_session("b", [key(2)])                # b moved on: block 1 is released
    for i in range(20, 30):
        tiered.put(key(i), payload(i))
    assert held(cpu, range(3)) == [2]
    assert tiered.pinned_blocks_by_tier() == {"cpu": 1}
    tiered.unpin_session("b")
    assert tiered.pin_stats().num_sessions == 0 and tiered.pin_stats().num_blocks == 0


def test_tiered_keeper_is_disk_and_cpu_demotes_pinned_blocks(tmp_path):
    cpu = MemoryStore(3 * BLOCK)
    disk = DiskStore(str(tmp_path), budget_bytes=30 * BLOCK, segment_bytes=4 * BLOCK)
    tiered = TieredStore([Tier("cpu", cpu), Tier("disk", disk, write_through=True)])
    assert tiered.keeper == 1
    tiered.pin_session("s", [key(0), key(1)])
    tiered.put(key(0), payload(0))
    tiered.put(key(1), payload(1))
    disk.delete(key(1))                              # as if the write-through put had failed
    for i in range(10, 100):                         # cpu evicts both; disk drops old segments
        tiered.put(key(i), payload(i))
    assert held(cpu, [0, 1]) == []                   # cpu is not the keeper: LRU as usual
    assert held(disk, [0, 1]) == [0, 1]              # block 1 was demoted, not dropped
    assert bytes(tiered.get(key(1))) == payload(1)   # and comes back (promoted into cpu)
    assert held(cpu, [1]) == [1]
    assert disk.stats().evictions > 0
    disk.close()
