"""The block pool's evictable counter follows every transition (random allocations, frees, caching
and prefix hits), so /metrics can report evictable blocks without a scan."""

from __future__ import annotations

import random

from kvhive.kv.pool import BlockPool


def test_the_evictable_count_follows_every_pool_transition() -> None:
    rng = random.Random(7)
    pool = BlockPool(17)
    held: list = []
    next_hash = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            held.extend(pool.get_new_blocks(rng.randint(1, min(3, pool.num_free_blocks))))
        elif op < 0.6 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.free_blocks([block])
        elif op < 0.8 and held:
            next_hash += 1
            pool.cache_block(rng.choice(held), next_hash.to_bytes(8, "big"))
        elif pool.cached:
            block = pool.get_cached_block(rng.choice(list(pool.cached)))
            pool.touch([block])                    # a prefix hit, evictable or used
            held.append(block)
        pool.check_integrity()                     # includes: counter == evictable blocks
        s = pool.stats()
        assert 0 <= s.num_evictable <= min(s.num_free, s.num_cached)
