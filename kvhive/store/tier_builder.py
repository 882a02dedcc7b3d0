"""The KV tiers below the device pool, built from ``StoreConfig``: CPU memory
(``--cpu-offload-gb``), then segment files in the disk cache dir (``--disk-cache-dir``), then Redis
(``--redis-url``, under the served model's ``RedisKeys``). Torch-free.

Disk and Redis are write-through: every saved block reaches them at once, so the disk tier survives
a kill of the process and Redis serves other replicas without waiting for evictions.
"""

from __future__ import annotations

import logging
import time

from kvhive.config import StoreConfig
from kvhive.store.disk import DiskStore
from kvhive.store.memory import MemoryStore
from kvhive.store.redis_keys import RedisKeys
from kvhive.store.tiered import Tier, TieredStore

logger = logging.getLogger(__name__)

_GB = 2**30


def build_tiered_store(config: StoreConfig, redis_keys: RedisKeys) -> TieredStore | None:
    """CPU memory -> disk -> Redis, as ``config`` sets them up; None when no tier is configured."""
    started = time.perf_counter()
    tiers: list[Tier] = []
    if config.cpu_offload_gb > 0:
        tiers.append(Tier("cpu", MemoryStore(int(config.cpu_offload_gb * _GB))))
    if config.disk_cache_dir is not None:
        tiers.append(Tier("disk", DiskStore(config.disk_cache_dir, int(config.disk_cache_gb * _GB)),
                          write_through=True))
    if config.redis_url is not None:
        from kvhive.store.redis import RedisStore

        tiers.append(Tier("redis", RedisStore(config.redis_url, ttl_seconds=config.redis_ttl_s,
                                              timeout_s=config.redis_timeout_s,
                                              key_prefix=redis_keys.kv_blocks), write_through=True))
    if not tiers:
        return None
    logger.info("KV tiers: %s opened in %.1f s", ", ".join(t.name for t in tiers), time.perf_counter() - started)
    return TieredStore(tiers)
