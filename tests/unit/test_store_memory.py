"""MemoryStore: LRU order, byte budget, evictions handed back, stats, thread safety."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvhive.store.key import KeySpace
from kvhive.store.memory import MemoryStore

SPACE = KeySpace("test-model", 1, "float32", 16)
BLOCK = 1000


def key(i: int):
    return SPACE.key(i.to_bytes(16, "little"))


def payload(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def test_put_get_contains_delete():
    store = MemoryStore(10 * BLOCK)
    assert store.get(key(1)) is None
    assert store.put(key(1), payload(1))
    assert store.get(key(1)) == payload(1)
    assert store.contains([key(1), key(2)]) == [True, False]
    store.delete(key(1))
    assert store.contains([key(1)]) == [False]
    assert store.stats().used_bytes == 0


def test_put_copies_mutable_buffers():
    store = MemoryStore(10 * BLOCK)
    buf = np.ones(BLOCK // 4, dtype=np.float32)
    store.put(key(1), buf)
    buf[:] = 7.0
    assert np.frombuffer(store.get(key(1)), dtype=np.float32)[0] == 1.0


def test_lru_eviction_under_budget_returns_evicted_blocks():
    store = MemoryStore(3 * BLOCK)
    for i in range(3):
        assert store.put(key(i), payload(i)).evicted == ()
    store.get(key(0))                                # 0 is now most recently used; 1 is the LRU
    assert store.contains([key(1)]) == [True]        # contains does not touch recency
    result = store.put(key(3), payload(3))
    assert result.stored and [e.key for e in result.evicted] == [key(1)]
    assert result.evicted[0].payload == payload(1)
    assert store.contains([key(i) for i in range(4)]) == [True, False, True, True]
    big = store.put(key(4), bytes(2 * BLOCK))        # needs two evictions: 2 then 0
    assert [e.key for e in big.evicted] == [key(2), key(0)]
    stats = store.stats()
    assert stats.evictions == 3 and stats.used_bytes <= stats.budget_bytes == 3 * BLOCK


def test_block_larger_than_budget_is_refused():
    store = MemoryStore(BLOCK)
    result = store.put(key(1), bytes(BLOCK + 1))
    assert not result and not result.stored
    assert store.stats().used_bytes == 0


def test_overwrite_keeps_accounting_exact():
    store = MemoryStore(10 * BLOCK)
    store.put(key(1), payload(1))
    store.put(key(1), bytes(BLOCK // 2))
    assert store.stats().used_bytes == BLOCK // 2


def test_stats_count_hits_misses_and_bytes():
    store = MemoryStore(10 * BLOCK)
    store.put(key(1), payload(1))
    store.get(key(1))
    store.get(key(2))
    s = store.stats()
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out, s.load_count) == (1, 1, BLOCK, BLOCK, 2)
    assert s.load_seconds_sum >= 0.0 and s.errors == 0


@pytest.mark.timeout(30)
def test_concurrent_puts_and_gets_keep_the_budget():
    store = MemoryStore(50 * BLOCK)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            i = int(rng.integers(200))
            if rng.random() < 0.5:
                store.put(key(i), payload(i))
            else:
                got = store.get(key(i))
                assert got is None or got == payload(i)

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(worker, seed) for seed in range(4)]:
            future.result()                                # re-raises a worker's failed assertion
    stats = store.stats()
    assert stats.used_bytes <= 50 * BLOCK
    assert stats.used_bytes == sum(store.contains([key(i) for i in range(200)])) * BLOCK
