"""Before a replica stops, the session blocks its shared tier lacks are copied down from the tiers
above it (real store tiers: a CPU memory tier over a write-through disk tier in the shared role)."""

from __future__ import annotations

from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.shared_copy import copy_missing, copy_to_shared_tier, shared_tier_index
from kvhive.store.tiered import Tier, TieredStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def key(i: int) -> StoreKey:
    return SPACE.key(i.to_bytes(16, "big"))


def tiers(path: str) -> TieredStore:
    return TieredStore([Tier("cpu", MemoryStore(16 * BLOCK)),
                        Tier("shared", DiskStore(path, 1_000_000, segment_bytes=100_000), write_through=True)])


def test_blocks_the_shared_tier_lacks_are_copied_from_the_cpu_tier(tmp_path) -> None:
    store = tiers(str(tmp_path))
    assert shared_tier_index(store) == 1 and shared_tier_index(None) is None
    store.put(key(1), bytes([1]) * BLOCK)                       # saved through to the shared tier
    for i in (2, 3):                                            # saves that never reached it
        store.tiers[0].store.put(key(i), bytes([i]) * BLOCK)
    keys = [key(1), key(2), key(3), key(4)]                     # 4 is held nowhere
    assert store.count_in_tier(1, keys) == 1
    assert copy_missing(store, 1, keys) == 2
    assert store.count_in_tier(1, keys) == 3
    assert store.tiers[1].store.get(key(3)) == bytes([3]) * BLOCK
    assert copy_missing(store, 1, keys) == 0                    # nothing left to copy
    copy = copy_to_shared_tier(store, keys)
    assert (copy.tier, copy.blocks, copy.copied, copy.in_shared_tier) == ("shared", 4, 0, 3)
    store.close()


def test_a_store_without_a_shared_tier_has_nothing_to_drain_into() -> None:
    alone = TieredStore([Tier("cpu", MemoryStore(4 * BLOCK))])
    assert shared_tier_index(alone) is None
    assert copy_to_shared_tier(alone, [key(1)]) is None and copy_to_shared_tier(None, [key(1)]) is None
