"""What outlives the process, built in one place: the KV tiers below the device pool, and where
session records and stored responses persist, all from ``--cpu-offload-gb``, ``--disk-cache-dir``
and ``--redis-url`` (``StoreConfig``).

``DurableState(config, model)`` builds each piece once; ``kvhive.launch`` hands it to its one owner:
the engine takes ``tiered_store()`` (built by ``kvhive.store.tier_builder``), the session registry
``session_backend()``, the response store ``response_backend()``. Torch-free.

Where each piece lives:

- KV blocks: CPU memory (``--cpu-offload-gb``), then segment files in the disk cache dir, then
  Redis; disk and Redis are write-through.
- Sessions and stored responses: Redis when configured (shared, so they move between replicas),
  else the disk cache dir (``sessions/``, ``responses/``; this replica's own), else nowhere.

Redis keys (``kvhive.store.redis_keys`` lists them): one namespace per served model,
``kvhive:{model}:`` (the served model name as is), so one ``SCAN kvhive:{model}:*`` or one ACL key
pattern covers everything a model's replicas write (KV blocks, session records, stored responses),
beside the global data-loss marker ``kvhive:data-marker``.

Replicas share blocks, sessions and responses when they share the Redis and the served model name;
the store key's model fingerprint still keeps blocks of other weights apart. The data marker stays
global: it reports that the Redis server lost its data (FLUSHALL, a restart without persistence),
one event for every model on it, and the process watches it once per Redis URL (``guard_for``), not
per model. A deployment that gives each model its own Redis ACL grants ``~kvhive:{model}:*`` and
``kvhive:data-marker``.
"""

from __future__ import annotations

from kvhive.config import StoreConfig
from kvhive.sessions.backends import FileBackend, RedisBackend, SessionBackend
from kvhive.sessions.response_backends import FileResponseBackend, RedisResponseBackend, ResponseBackend
from kvhive.store.redis_keys import RedisKeys
from kvhive.store.tier_builder import build_tiered_store
from kvhive.store.tiered import TieredStore


class DurableState:
    """Builds one served model's KV tiers and record backends from its ``StoreConfig``."""

    def __init__(self, config: StoreConfig, model: str) -> None:
        self.config = config
        self.redis_keys = RedisKeys(model)

    def tiered_store(self) -> TieredStore | None:
        """CPU memory -> disk -> Redis, as configured; None when no tier is
        (``kvhive.store.tier_builder``)."""
        return build_tiered_store(self.config, self.redis_keys)

    def session_backend(self) -> SessionBackend | None:
        """Where session records persist: Redis (shared, so sessions move between replicas), else
        the disk cache dir (this replica's own), else nowhere."""
        if self.config.redis_url is not None:
            return RedisBackend(self.config.redis_url, self.redis_keys.sessions,
                                timeout_s=self.config.redis_timeout_s)
        if self.config.disk_cache_dir is not None:
            return FileBackend(self.config.disk_cache_dir)
        return None

    def response_backend(self) -> ResponseBackend | None:
        """Where stored responses persist: where sessions do."""
        if self.config.redis_url is not None:
            return RedisResponseBackend(self.config.redis_url, self.redis_keys.responses,
                                        timeout_s=self.config.redis_timeout_s)
        if self.config.disk_cache_dir is not None:
            return FileResponseBackend(self.config.disk_cache_dir)
        return None
