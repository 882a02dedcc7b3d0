"""The in-memory KV block index: a bounded LRU, written by many replicas' threads at once."""

from __future__ import annotations

import threading

import pytest

from kvhive.routing.index import InMemoryIndex


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def test_in_memory_index_is_a_bounded_lru() -> None:
    index = InMemoryIndex(max_keys=3)
    index.add(keys(0, 1, 2), "a", "GPU")
    assert index.lookup(keys(0)) == [{"a": "GPU"}]    # 0 becomes the most recently used
    index.add(keys(3), "b", "GPU")                    # evicts 1, the least recently used
    assert len(index) == 3
    assert index.lookup(keys(1)) == []
    assert [bool(index.lookup(keys(i))) for i in (0, 2, 3)] == [True, True, True]
    index.clear_replica("a")                          # evicted keys left the replica's set too
    assert len(index) == 1 and index.lookup(keys(3)) == [{"b": "GPU"}]
    with pytest.raises(ValueError):
        InMemoryIndex(max_keys=0)


def test_in_memory_index_many_replicas_and_threads() -> None:
    index = InMemoryIndex(max_keys=100_000)

    def writer(r: int) -> None:
        for i in range(0, 1000, 10):
            index.add(keys(*range(i, i + 10)), f"r{r}", "GPU" if r % 2 else "CPU")

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hits = index.lookup(keys(*range(1000)))
    assert len(hits) == 1000
    assert hits[500] == {f"r{r}": "GPU" if r % 2 else "CPU" for r in range(20)}
