"""The global KV block index: block key -> the replicas holding it, and in which tier (seed 001).

Keys are kvhive block hashes (16 bytes). Each (replica, medium) copy of a block is tracked on its own,
so removing a block from a replica's device pool keeps the entry for its CPU or disk copy.
``InMemoryIndex`` is a bounded LRU for one gateway; ``RedisIndex`` is shared by several gateways.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from kvhive.events import MEDIA, normalize_medium

# A block's copies in one replica are a 4-bit mask: bit i set <=> the replica holds it in MEDIA[i].
_MEDIA_BITS = len(MEDIA)
_ALL_MEDIA = (1 << _MEDIA_BITS) - 1


def _medium_bit(medium: str) -> int:
    return 1 << MEDIA.index(normalize_medium(medium))


def _fastest(mask: int) -> str:
    return MEDIA[(mask & -mask).bit_length() - 1]


class KVBlockIndex(Protocol):
    """Which replicas hold which KV blocks, in which tier. Implementations are thread-safe."""

    def add(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Record that ``replica`` holds each of ``keys`` in ``medium``."""
        ...

    def remove(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Forget ``replica``'s copy of each key in ``medium``; its other tiers and other replicas stay."""
        ...

    def clear_replica(self, replica: str) -> None:
        """Forget every block ``replica`` holds (it restarted, was cleared, or is gone)."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """For each key in order, replica -> fastest medium holding it; stops before the first key
        that no replica holds (the result is as long as the prefix somebody holds)."""
        ...


class InMemoryIndex:
    """A bounded LRU index in process memory: beyond ``max_keys`` the least recently used key goes."""

    def __init__(self, max_keys: int = 1_000_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._lock = threading.Lock()
        # key -> one int for all replicas: bits [4r, 4r+4) are replica r's media mask. Never 0.
        # Oldest (least recently added or looked up) first.
        self._entries: OrderedDict[bytes, int] = OrderedDict()
        # Invariant: key in _keys_of[r] <=> bits of replica r in _entries[key] are not all 0.
        self._keys_of: list[set[bytes]] = []
        self._replica_ids: dict[str, int] = {}
        self._replica_names: list[str] = []
        # mask -> its holders dict (replica ids keep their names, so an entry never goes stale).
        # Few distinct masks occur (usually one replica, one tier), so most lookups hit this.
        self._holders_of: dict[int, dict[str, str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _rid(self, replica: str) -> int:
        rid = self._replica_ids.get(replica)
        if rid is None:
            rid = self._replica_ids[replica] = len(self._replica_names)
            self._replica_names.append(replica)
            self._keys_of.append(set())
        return rid

    def add(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Record that ``replica`` holds each of ``keys`` in ``medium`` (they become most recent)."""
        with self._lock:
            rid = self._rid(replica)
            bit = _medium_bit(medium) << (rid * _MEDIA_BITS)
            entries, held = self._entries, self._keys_of[rid]
            for key in keys:
                entries[key] = entries.get(key, 0) | bit
                entries.move_to_end(key)
                held.add(key)
            while len(entries) > self.max_keys:
                key, mask = entries.popitem(last=False)
                self._forget_everywhere(key, mask)

    def remove(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Forget ``replica``'s copy of each key in ``medium``."""
        with self._lock:
            rid = self._replica_ids.get(replica)
            if rid is None:
                return
            shift = rid * _MEDIA_BITS
            bit = _medium_bit(medium) << shift
            for key in keys:
                mask = self._entries.get(key)
                if mask is None:
                    continue
                mask &= ~bit
                if not (mask >> shift) & _ALL_MEDIA:
                    self._keys_of[rid].discard(key)
                if mask:
                    self._entries[key] = mask
                else:
                    del self._entries[key]

    def clear_replica(self, replica: str) -> None:
        """Forget every block ``replica`` holds."""
        with self._lock:
            rid = self._replica_ids.get(replica)
            if rid is None:
                return
            keep = ~(_ALL_MEDIA << (rid * _MEDIA_BITS))
            for key in self._keys_of[rid]:
                mask = self._entries[key] & keep
                if mask:
                    self._entries[key] = mask
                else:
                    del self._entries[key]
            self._keys_of[rid] = set()

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """Replica -> fastest medium for each key of the held prefix; hits become most recent.
        The dicts are shared between calls: callers must not change them."""
        out: list[dict[str, str]] = []
        entries, cached = self._entries, self._holders_of
        with self._lock:
            for key in keys:
                mask = entries.get(key)
                if mask is None:
                    break
                entries.move_to_end(key)
                holders = cached.get(mask)
                if holders is None:
                    if len(cached) >= 4096:
                        cached.clear()
                    holders = cached[mask] = self._holders(mask)
                out.append(holders)
        return out

    def _holders(self, mask: int) -> dict[str, str]:
        holders: dict[str, str] = {}
        while mask:
            low = mask & -mask
            bit = low.bit_length() - 1
            name = self._replica_names[bit // _MEDIA_BITS]
            # Bits are visited low to high, so a replica's first bit is its fastest medium.
            holders.setdefault(name, MEDIA[bit % _MEDIA_BITS])
            mask ^= low
        return holders

    def _forget_everywhere(self, key: bytes, mask: int) -> None:
        for rid, held in enumerate(self._keys_of):
            if (mask >> (rid * _MEDIA_BITS)) & _ALL_MEDIA:
                held.discard(key)


# KEYS[1] = the replica's key set, KEYS[2..] = block keys; ARGV = replica, medium bit, ttl seconds.
_ADD_LUA = """
local r, b, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 2, #KEYS do
  local m = tonumber(redis.call('HGET', KEYS[i], r) or '0')
  redis.call('HSET', KEYS[i], r, bit.bor(m, b))
  if ttl > 0 then redis.call('EXPIRE', KEYS[i], ttl) end
  redis.call('SADD', KEYS[1], KEYS[i])
end
"""
_REMOVE_LUA = """
local r, b = ARGV[1], tonumber(ARGV[2])
for i = 2, #KEYS do
  local m = bit.band(tonumber(redis.call('HGET', KEYS[i], r) or '0'), bit.bnot(b))
  if m == 0 then
    redis.call('HDEL', KEYS[i], r)
    redis.call('SREM', KEYS[1], KEYS[i])
  else
    redis.call('HSET', KEYS[i], r, m)
  end
end
"""

# KEYS = block keys. One line per key up to the first key nobody holds: "replica=mask" fields joined
# by tabs (replica names are URLs: no tab or newline). One reply string instead of a reply per key.
_LOOKUP_LUA = r"""
local out = {}
for i = 1, #KEYS do
  local f = redis.call('HGETALL', KEYS[i])
  if #f == 0 then break end
  local parts = {}
  for j = 1, #f, 2 do parts[#parts + 1] = f[j] .. '=' .. f[j + 1] end
  out[#out + 1] = table.concat(parts, '\t')
end
return table.concat(out, '\n')
"""


class RedisIndex:
    """The index in Redis, shared by gateways: one hash per block key, field replica -> media mask.

    Layout: ``{prefix}b:<16-byte key>`` -> {replica: mask}; ``{prefix}r:<replica>`` -> set of the
    block keys it holds (to clear a replica). add/remove are one Lua call per batch (atomic per
    batch, so two gateways ingesting the same events agree); lookup is one Lua call: one round trip,
    one reply string, stopping at the first key nobody holds.
    """

    def __init__(self, url: str = "redis://localhost:6379/0", prefix: str = "kvhive:idx:",
                 key_ttl_s: int = 0, client: Any = None) -> None:
        import redis  # optional dependency: only this backend needs it

        self._redis = client if client is not None else redis.Redis.from_url(url)
        self._prefix = prefix.encode()
        self._ttl = key_ttl_s
        self._add = self._redis.register_script(_ADD_LUA)
        self._remove = self._redis.register_script(_REMOVE_LUA)
        self._lookup = self._redis.register_script(_LOOKUP_LUA)

    def _key(self, key: bytes) -> bytes:
        return self._prefix + b"b:" + key

    def _set(self, replica: str) -> bytes:
        return self._prefix + b"r:" + replica.encode()

    def add(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Record that ``replica`` holds each of ``keys`` in ``medium``."""
        if keys:
            self._add(keys=[self._set(replica), *map(self._key, keys)],
                      args=[replica, _medium_bit(medium), self._ttl])

    def remove(self, keys: Sequence[bytes], replica: str, medium: str) -> None:
        """Forget ``replica``'s copy of each key in ``medium``."""
        if keys:
            self._remove(keys=[self._set(replica), *map(self._key, keys)],
                         args=[replica, _medium_bit(medium)])

    def clear_replica(self, replica: str, chunk: int = 1000) -> None:
        """Forget every block ``replica`` holds (scans its key set in chunks, then deletes it)."""
        members = self._set(replica)
        batch: list[bytes] = []
        for key in self._redis.sscan_iter(members, count=chunk):
            batch.append(key)
            if len(batch) >= chunk:
                self._hdel_all(batch, replica)
                batch = []
        self._hdel_all(batch, replica)
        self._redis.delete(members)

    def _hdel_all(self, keys: list[bytes], replica: str) -> None:
        if keys:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hdel(key, replica)
            pipe.execute()

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """Replica -> fastest medium for each key of the held prefix, in one round trip."""
        if not keys:
            return []
        raw = self._lookup(keys=[self._key(k) for k in keys])
        out: list[dict[str, str]] = []
        for line in raw.split(b"\n") if raw else ():
            holders = {}
            for field in line.split(b"\t"):
                name, _, mask = field.rpartition(b"=")
                if int(mask) & _ALL_MEDIA:
                    holders[name.decode()] = _fastest(int(mask))
            if not holders:
                break
            out.append(holders)
        return out

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()
