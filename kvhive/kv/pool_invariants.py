"""The block pool's invariants, checked: the state table and maps of ``kvhive.kv.pool`` hold.

O(num_blocks) each, for tests (``BlockPool.check_integrity``); every failure raises
AssertionError with what disagreed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhive.core.retention import DEFAULT_PRIORITY
from kvhive.kv.pool import NULL_BLOCK_ID, is_reusable

if TYPE_CHECKING:
    from kvhive.kv.pool import BlockPool


def check(ok: bool, msg: str) -> None:
    """Raise AssertionError(msg) unless ``ok``."""
    if not ok:
        raise AssertionError(msg)


def check_pool(pool: BlockPool) -> None:
    """Raise AssertionError unless queue, ref counts, hash map, listings and retentions agree."""
    queued = check_free_queue(pool)
    check(NULL_BLOCK_ID not in queued, "null block in the free queue")
    check_block_states(pool, queued)
    check_hash_map(pool)
    check_retention(pool)


def check_free_queue(pool: BlockPool) -> set[int]:
    """Every queued block is free, in its right list, linked and counted once; returns their ids."""
    queued: set[int] = set()
    q = pool.free_queue
    check(q.levels_order == sorted(q.levels), "priority levels out of order")
    for level, blocks in [(None, q.empty)] + [(p, q.levels[p]) for p in q.levels_order]:
        check(level is None or len(blocks) > 0, f"empty list kept for priority {level}")
        prev = None
        for block in blocks:
            check(block.prev_free is prev, f"broken back link at {block}")
            check(block.block_id not in queued, f"{block} queued twice")
            check(block.ref_cnt == 0, f"{block} in the free queue with ref_cnt > 0")
            check(is_reusable(block) == (level is not None), f"{block} in the wrong list (reusable or not)")
            check(level is None or block.priority == level, f"{block} queued under priority {level}")
            queued.add(block.block_id)
            prev = block
        check(len(blocks) == sum(1 for _ in blocks), f"length counter of list {level} is wrong")
    check(len(queued) == len(q), "free queue length counter is wrong")
    return queued


def check_block_states(pool: BlockPool, queued: set[int]) -> None:
    """empty + evictable + used == total, ref_cnt == 0 <=> queued, and the evictable counter is true."""
    empty = evictable = used = 0
    for block in pool.blocks[1:]:
        check(block.ref_cnt >= 0, f"{block} has a negative ref count")
        check((block.ref_cnt == 0) == (block.block_id in queued), f"{block}: ref_cnt vs queue")
        if block.block_hash is not None:
            check(pool.cached.get(block.block_hash) is block, f"{block} hashed but not mapped")
        if block.ref_cnt > 0:
            used += 1
        elif not is_reusable(block):
            empty += 1
        else:
            evictable += 1
    check(empty + evictable + used == pool.num_blocks - 1, "empty + evictable + used != total")
    num_evictable = pool.stats().num_evictable
    check(evictable == num_evictable, f"evictable counter {num_evictable} != {evictable}")


def check_hash_map(pool: BlockPool) -> None:
    """Map entries point at their blocks; every listed block sits under its parent with its tokens."""
    for h, block in pool.cached.items():
        check(block.block_hash == h, f"map entry {h.hex()[:8]} points at {block}")
    listed = 0
    for parent, siblings in pool.children.items():
        check(bool(siblings), f"empty child list under {parent.hex()[:8]}")
        for block in siblings.values():
            check(block.parent_hash == parent and block.token_ids is not None,
                  f"{block} listed under {parent.hex()[:8]} without that parent or tokens")
            check(block.block_hash is None or pool.cached.get(block.block_hash) is block,
                  f"{block} listed with a hash that is not cached")
            listed += 1
    check(listed == sum(1 for b in pool.blocks if b.parent_hash is not None),
          "a block with a parent is missing from its parent's list")


def check_retention(pool: BlockPool) -> None:
    """Priorities in bounds, a default or unretained block has no expiry, a block handed out or
    empty has no retention, every expiry has its heap entry."""
    entries = {(e, b.block_id) for e, _, b in pool.expiry_heap}
    for block in pool.blocks:
        check(0 <= block.priority <= 100, f"{block} priority out of [0, 100]")
        if not block.retained:
            check(block.priority == DEFAULT_PRIORITY and block.expiry is None,
                  f"{block} has a retention it was never given")
        if block.expiry is not None:
            check(block.priority != DEFAULT_PRIORITY, f"{block} expires to the priority it has")
            check((block.expiry, block.block_id) in entries, f"{block} expiry missing from the heap")
        if not is_reusable(block):
            check(not block.retained, f"{block} holds nothing reusable but has a retention")
    check(len(pool.expiry_heap) <= 2 * pool.num_blocks + 64, "expiry heap not compacted")
