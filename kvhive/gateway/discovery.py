"""``kvhive gateway --discover``: replicas that register themselves in Redis (``kvhive serve
--register``; layout in ``kvhive.core.replica_registry``) join the gateway's replicas, beside any static
``--replica``, and leave it when their heartbeat stops.

Every ``interval_s`` the gateway reads the registry in one round trip (a Lua script that also
removes members whose record has expired) and notes, per replica, when its record expires by the
TTL Redis reports. A new record adds the replica (checked at once, routed to once its /health
passes, its KV events subscribed to); a record marked ``leaving`` removes it at once; a replica
whose record is gone is removed once the expiry last seen has passed. So a replica whose heartbeat
stops is removed within TTL + ``interval_s`` of its last beat, and a Redis that lost its data
(FLUSHALL, a restart) removes nobody: its live replicas write their record again within a
heartbeat (TTL / 3), before the expiry last seen. While Redis cannot be reached, the gateway keeps
the replicas it has (its health checks still stop routing to dead ones), and after it answers
again each replica gets one more TTL to beat before a missing record removes it (a hung Redis
expires every record the moment it resumes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvhive.core.replica_registry import MEMBERS_KEY, RECORD_KEY_PREFIX, ReplicaRecord
from kvhive.gateway.gateway_config import ReplicaSpec
from kvhive.gateway.replicas import Replica, ReplicaSet
from kvhive.routing.redis_link import RedisLink, SharedStateUnavailable

logger = logging.getLogger(__name__)

# KEYS[1] = the members set; ARGV[1] = the record key prefix. Returns record, PTTL pairs of the
# members that have a record, and removes the members that have none (atomic, so a heartbeat's
# SET + SADD never lands between the read and the removal).
_READ_LUA = """
local out = {}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[1] .. member
  local value = redis.call('GET', key)
  if value then
    out[#out + 1] = value
    out[#out + 1] = redis.call('PTTL', key)
  else
    redis.call('SREM', KEYS[1], member)
  end
end
return out
"""


@dataclass(frozen=True)
class Registered:
    """A record read from the registry and the seconds Redis keeps it without another heartbeat."""

    record: ReplicaRecord
    expires_in_s: float


class RegistryReader:
    """Reads the registry (blocking: call it off the event loop)."""

    def __init__(self, link: RedisLink) -> None:
        self.link = link
        self._read = link.client.register_script(_READ_LUA)

    def read(self) -> list[Registered]:
        """Every registered record; SharedStateUnavailable when Redis cannot be reached."""
        raw = self.link.call(lambda: self._read(keys=[MEMBERS_KEY], args=[RECORD_KEY_PREFIX]))
        out = []
        for value, pttl in zip(raw[::2], raw[1::2], strict=True):
            record = ReplicaRecord.decode(value)
            if record is None:
                continue
            expires_in = pttl / 1000 if pttl >= 0 else record.ttl_s     # -1: no expiry set
            out.append(Registered(record, expires_in))
        return out


class ReplicaDiscovery:
    """Keeps a ReplicaSet in step with the registry (see the module docstring)."""

    def __init__(self, reader: RegistryReader, replica_set: ReplicaSet,
                 make_replica: Callable[[ReplicaSpec], Replica], interval_s: float = 1.0,
                 fingerprint: str = "", static: Collection[str] = ()) -> None:
        self.reader = reader
        self.replica_set = replica_set
        self.make_replica = make_replica
        self.interval_s = interval_s
        self.fingerprint = fingerprint
        self.static = frozenset(static)         # --replica URLs: never added nor removed here
        self._expires: dict[str, float] = {}    # discovered replica -> monotonic expiry last seen
        self._ttl: dict[str, float] = {}        # discovered replica -> its registration TTL
        self._specs: dict[str, ReplicaSpec] = {}
        self._blind = False                     # the last read could not reach Redis
        self._refused: set[str] = set()         # URLs whose other model was logged once

    @property
    def discovered(self) -> list[str]:
        """The URLs of the replicas discovery added and has not removed."""
        return list(self._specs)

    async def run(self) -> None:
        """Poll every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def poll(self) -> None:
        """Read the registry once and add or remove replicas by it (nothing when unreachable)."""
        try:
            registered = await asyncio.to_thread(self.reader.read)
        except SharedStateUnavailable:
            self._blind = True
            return
        now = time.monotonic()
        if self._blind:                 # back after an outage: one more TTL to beat for everyone
            self._blind = False
            for name in self._specs:
                self._expires[name] = max(self._expires[name], now + self._ttl[name])
        live: dict[str, ReplicaSpec] = {}
        for entry in registered:
            spec = self._accepted(entry.record)
            if spec is None:
                continue
            if entry.record.leaving:
                await self._remove(spec.name, "it deregistered")
                continue
            live[spec.name] = spec
            self._expires[spec.name] = now + entry.expires_in_s
            self._ttl[spec.name] = entry.record.ttl_s
        for name in [n for n in self._specs if n not in live and now > self._expires[n]]:
            await self._remove(name, "its registration expired")
        await self._add([spec for name, spec in live.items() if self._specs.get(name) != spec])

    def _accepted(self, record: ReplicaRecord) -> ReplicaSpec | None:
        """The spec of a record this gateway routes to: not a static replica, a valid URL, and the
        gateway's model (same fingerprint, where both name one)."""
        if record.url in self.static:
            return None
        if self.fingerprint and record.fingerprint and record.fingerprint != self.fingerprint:
            if record.url not in self._refused:
                self._refused.add(record.url)
                logger.warning("registered replica %s serves another model (fingerprint %s, not %s): "
                               "not routed to", record.url, record.fingerprint, self.fingerprint)
            return None
        try:
            return ReplicaSpec(record.url, record.events, record.replay if record.events else None)
        except ValueError as exc:
            logger.warning("registered replica skipped: %s", exc)
            return None

    async def _add(self, specs: list[ReplicaSpec]) -> None:
        """Add each spec's replica (one whose spec changed is replaced), start its event stream and
        check it at once."""
        added = []
        for spec in specs:
            if spec.name in self._specs:
                await self._remove(spec.name, "its registration changed")
            replica = self.make_replica(spec)
            if not self.replica_set.add(replica):
                continue
            self._specs[spec.name] = spec
            logger.info("replica %s registered itself; checking it", spec.name)
            if replica.ingest is not None:
                replica.ingest.start()
            added.append(replica)
        await asyncio.gather(*(self.replica_set.check(r) for r in added))

    async def _remove(self, name: str, why: str) -> None:
        if self._specs.pop(name, None) is not None:
            self._expires.pop(name, None)
            self._ttl.pop(name, None)
            await self.replica_set.remove(name, why)


def registered_specs(link: RedisLink, wait_s: float = 10.0) -> tuple[ReplicaSpec, ...]:
    """The specs of the replicas registered now (waiting up to ``wait_s`` for a first one), for
    reading their block-hash settings at start; () when none registers or Redis is unreachable."""
    reader = RegistryReader(link)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            records = [r.record for r in reader.read() if not r.record.leaving]
        except SharedStateUnavailable:
            records = []
        specs = []
        for record in records:
            try:
                specs.append(ReplicaSpec(record.url))
            except ValueError:
                continue
        if specs or time.monotonic() >= deadline:
            return tuple(specs)
        time.sleep(0.5)
