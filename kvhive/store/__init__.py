"""KV block stores: keys, the record codec, and the memory / disk / Redis tiers (torch-free).

RedisStore is imported from ``kvhive.store.redis`` so that redis-py stays optional.
"""

from __future__ import annotations

from kvhive.store.base import BlockStore, Evicted, Payload, PutResult, StatsCounter, StoreStats
from kvhive.store.codec import decode_block, encode_block
from kvhive.store.disk import DiskStore
from kvhive.store.key import KeySpace, StoreKey
from kvhive.store.memory import MemoryStore
from kvhive.store.tiered import PinStats, Tier, TieredStore

__all__ = [
    "BlockStore", "DiskStore", "Evicted", "KeySpace", "MemoryStore", "Payload", "PutResult",
    "PinStats", "StatsCounter", "StoreKey", "StoreStats", "Tier", "TieredStore", "decode_block",
    "encode_block",
]
