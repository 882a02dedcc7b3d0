"""The global KV block index: block key -> the replicas holding it, and in which tier (llm-d's kv-block index).

Keys are kvhive block hashes (16 bytes). Each (replica, medium) copy of a block is tracked on its own,
so removing a block from a replica's device pool keeps the entry for its CPU or disk copy.
``InMemoryIndex`` is a bounded LRU for one gateway; ``RedisIndex`` is shared by several gateways.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any, Protocol

from kvhive.core.kv_events import MEDIA, normalize_medium

# A block's copies in one replica are a 4-bit mask: bit i set <=> the replica holds it in MEDIA[i].
_MEDIA_BITS = len(MEDIA)
_ALL_MEDIA = (1 << _MEDIA_BITS) - 1
# Keys an in-memory lookup reads per C-level pass before it checks for the first miss.
_LOOKUP_CHUNK = 64


def _medium_bit(medium: str) -> int:
    return 1 << MEDIA.index(normalize_medium(medium))


def _fastest(mask: int) -> str:
    return MEDIA[(mask & -mask).bit_length() - 1]


def _parse_holders(line: bytes) -> dict[str, str]:
    """Replica -> fastest medium from a Redis value ("replica=mask" fields joined by tabs)."""
    holders = {}
    for field in line.split(b"\t"):
        name, _, mask = field.rpartition(b"=")
        if mask.isdigit() and int(mask) & _ALL_MEDIA:
            holders[name.decode()] = _fastest(int(mask) & _ALL_MEDIA)
    return holders


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
            # Chunks of keys go through C-level map() calls (no per-key Python bytecode); the walk
            # stops at the first chunk that holds a key nobody holds.
            for start in range(0, len(keys), _LOOKUP_CHUNK):
                chunk = keys[start:start + _LOOKUP_CHUNK]
                masks = list(map(entries.get, chunk))
                try:
                    held = masks.index(None)
                except ValueError:
                    held = len(masks)
                if held < len(masks):
                    del masks[held:]
                    chunk = chunk[:held]
                deque(map(entries.move_to_end, chunk), maxlen=0)
                holders = list(map(cached.get, masks))
                if None in holders:
                    if len(cached) >= 4096:
                        cached.clear()
                    holders = [cached.get(m) or cached.setdefault(m, self._holders(m)) for m in masks]
                out += holders
                if held < _LOOKUP_CHUNK:
                    break
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


# A block's value in Redis is one string of "replica=mask" fields joined by tabs (replica names are
# URLs: no tab or newline). ``_FIELDS_LUA`` reads it into (the other replicas' fields, this one's mask).
_FIELDS_LUA = """
local function fields(value, replica)
  local others, mine = {}, 0
  if value then
    for f in string.gmatch(value, '[^\t]+') do
      local name, mask = string.match(f, '^(.*)=(%d+)$')
      if name == replica then mine = tonumber(mask) else others[#others + 1] = f end
    end
  end
  return others, mine
end
"""
# KEYS[1] = the replica's key set, KEYS[2..] = block keys; ARGV = replica, medium bit, ttl seconds.
_ADD_LUA = _FIELDS_LUA + """
local r, b, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 2, #KEYS do
  local others, mine = fields(redis.call('GET', KEYS[i]), r)
  others[#others + 1] = r .. '=' .. bit.bor(mine, b)
  if ttl > 0 then
    redis.call('SET', KEYS[i], table.concat(others, '\t'), 'EX', ttl)
  else
    redis.call('SET', KEYS[i], table.concat(others, '\t'))
  end
  redis.call('SADD', KEYS[1], KEYS[i])
end
"""
# KEYS as for _ADD_LUA; ARGV = replica, the medium bits to drop.
_REMOVE_LUA = _FIELDS_LUA + """
local r, b = ARGV[1], tonumber(ARGV[2])
for i = 2, #KEYS do
  local value = redis.call('GET', KEYS[i])
  local others, mine = fields(value, r)
  local m = bit.band(mine, bit.bnot(b))
  if m ~= 0 then others[#others + 1] = r .. '=' .. m end
  if m == 0 then redis.call('SREM', KEYS[1], KEYS[i]) end
  if #others == 0 then
    if value then redis.call('DEL', KEYS[i]) end
  elseif m ~= mine then
    redis.call('SET', KEYS[i], table.concat(others, '\t'), 'KEEPTTL')
  end
end
"""
# ARGV[1] = the key prefix, ARGV[2] = the block keys concatenated, ARGV[3] = their length. Values of
# the keys up to the first key nobody holds, joined by newlines: one reply string, read with MGETs of
# _MGET_CHUNK keys that stop after the first chunk holding a miss. The block keys travel as one
# argument, not as KEYS: redis-py packs each argument in Python, which for a 400-block prompt cost
# more than the whole script. (Neither this nor a replica's key set suits Redis Cluster.)
_MGET_CHUNK = 256
_LOOKUP_LUA = """
local CHUNK = _MGET_CHUNK
local prefix, blob, width = ARGV[1], ARGV[2], tonumber(ARGV[3])
local n, out = #blob / width, {}
for first = 1, n, CHUNK do
  local last = math.min(first + CHUNK - 1, n)
  local names = {}
  for i = first, last do
    names[#names + 1] = prefix .. string.sub(blob, (i - 1) * width + 1, i * width)
  end
  local values = redis.call('MGET', unpack(names))
  for i = 1, #names do
    if not values[i] then return table.concat(out, '\\n') end
    out[#out + 1] = values[i]
  end
end
return table.concat(out, '\\n')
""".replace("_MGET_CHUNK", str(_MGET_CHUNK))


class RedisIndex:
    """The index in Redis, shared by gateways: one string per block key naming its holders.

    Layout: ``{prefix}v:<16-byte key>`` -> "replica=mask" fields joined by tabs (see ``_FIELDS_LUA``);
    ``{prefix}r:<replica>`` -> set of the block keys it holds (to clear a replica). add/remove are one
    Lua call per batch (atomic per batch, so two gateways ingesting the same events agree); lookup is
    one Lua call: one round trip, MGETs inside Redis, one reply string, stopping at the first key
    nobody holds.
    """

    def __init__(self, url: str = "redis://localhost:6379/0", prefix: str = "kvhive:idx:",
                 key_ttl_s: int = 0, client: Any = None) -> None:
        import redis  # optional dependency: only this backend needs it

        self._redis = client if client is not None else redis.Redis.from_url(url)
        self._prefix = prefix.encode()
        self._value_prefix = self._prefix + b"v:"
        self._ttl = key_ttl_s
        self._add = self._redis.register_script(_ADD_LUA)
        self._remove = self._redis.register_script(_REMOVE_LUA)
        self._lookup = self._redis.register_script(_LOOKUP_LUA)
        # A reply line (one block's value) -> its holders dict. Few distinct lines occur (one per
        # set of holders), so parsing is one dict lookup per block. Event-loop and pool threads
        # share it; a lost insert under a race only costs a re-parse.
        self._parsed: dict[bytes, dict[str, str]] = {}

    def _key(self, key: bytes) -> bytes:
        return self._value_prefix + key

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
                self._remove(keys=[members, *batch], args=[replica, _ALL_MEDIA])
                batch = []
        if batch:
            self._remove(keys=[members, *batch], args=[replica, _ALL_MEDIA])
        self._redis.delete(members)

    def lookup(self, keys: Sequence[bytes]) -> list[dict[str, str]]:
        """Replica -> fastest medium for each key of the held prefix, in one round trip.
        The dicts are shared between calls: callers must not change them."""
        if not keys:
            return []
        width = len(keys[0])
        blob = b"".join(keys)
        if len(blob) != width * len(keys):
            raise ValueError("RedisIndex.lookup: block keys must all have the same length")
        raw = self._lookup(keys=[], args=[self._value_prefix, blob, width])
        if not raw:
            return []
        parsed, lines = self._parsed, raw.split(b"\n")
        out = list(map(parsed.get, lines))
        if None in out:
            if len(parsed) >= 4096:
                parsed.clear()
            out = [parsed.get(line) or parsed.setdefault(line, _parse_holders(line)) for line in lines]
        if {} in out:                    # a value whose masks are all 0 (not written by this class)
            del out[out.index({}):]
        return out

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()
