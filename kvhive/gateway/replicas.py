"""The replicas behind the gateway: health checks, load from their /metrics, drop and restore."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvhive.gateway.event_watch import EventSilence
from kvhive.gateway.gateway_config import ReplicaSpec
from kvhive.gateway.outlier import OutlierState
from kvhive.routing.index import KVBlockIndex
from kvhive.routing.ingest import ReplicaIngest
from kvhive.routing.scorer import LoadStats

logger = logging.getLogger(__name__)

# Prometheus names of the load figures: kvhive's, then vLLM's (older and newer KV usage names).
_RUNNING = ("kvhive_num_requests_running", "vllm:num_requests_running")
_WAITING = ("kvhive_num_requests_waiting", "vllm:num_requests_waiting")
_KV_USAGE = ("kvhive_kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_LOAD_NAMES = _RUNNING + _WAITING + _KV_USAGE


def parse_load(text: str) -> LoadStats:
    """Running and waiting requests (summed over label sets) and KV usage (the largest) from
    Prometheus text; absent metrics count 0. Each line of a load figure is read with
    ``prometheus_client``'s parser on its own (the other lines are never parsed, which keeps a poll
    cheap on the event loop), and a line that does not parse is skipped."""
    running = waiting = usage = 0.0
    for line in text.splitlines():
        if not line.startswith(_LOAD_NAMES):
            continue
        try:
            samples = [s for family in text_string_to_metric_families(line + "\n") for s in family.samples]
        except ValueError:
            continue
        for sample in samples:
            if sample.name in _RUNNING:
                running += sample.value
            elif sample.name in _WAITING:
                waiting += sample.value
            elif sample.name in _KV_USAGE:
                usage = max(usage, sample.value)
    return LoadStats(running, waiting, usage)


@dataclass
class Replica:
    """One backend and what the gateway knows of it (changed on the event loop only)."""

    spec: ReplicaSpec
    ingest: ReplicaIngest | None = None
    healthy: bool = False
    load: LoadStats = field(default_factory=LoadStats)
    inflight: int = 0           # requests the gateway has sent and not finished reading
    finished: int = 0           # requests the gateway has finished reading, ever
    finished_at_poll: int = 0   # ``finished`` when the last good /metrics poll was sent
    failures: int = 0           # consecutive failed health checks
    outlier: OutlierState = field(default_factory=OutlierState)     # failed requests, ejections
    events: EventSilence | None = None      # watches the events endpoint, where there is one

    @property
    def name(self) -> str:
        """The replica's URL, its name everywhere."""
        return self.spec.name

    def routed(self, now: float) -> None:
        """A request is sent to the replica at ``now`` (``time.monotonic()``)."""
        if self.events is not None:
            self.events.routed(now, self.events_heard())

    def events_heard(self) -> bool:
        """Whether a KV event arrived on its events endpoint since the subscription (re)started."""
        return self.ingest is not None and self.ingest.received_at is not None

    def describe(self, now: float, wall: float) -> dict[str, object]:
        """Its state for /health: health, routing (ok, ejected, probation), failed requests in a row,
        ejections, while ejected until when (UTC, and seconds left), and its events' state."""
        routing = self.outlier.state(now)
        out: dict[str, object] = {"health": "up" if self.healthy else "down", "routing": routing,
                                  "consecutive_failures": self.outlier.consecutive,
                                  "ejections": self.outlier.ejections}
        if routing == "ejected" and self.outlier.ejected_until is not None:
            left = self.outlier.ejected_until - now
            until = datetime.fromtimestamp(wall + left, timezone.utc)
            out["ejected_until"] = until.isoformat(timespec="milliseconds")
            out["ejected_for_s"] = round(left, 3)
        if self.events is not None:
            out["events"] = {"endpoint": self.events.endpoint,
                             "state": self.events.check(now, self.events_heard())}
        return out

    def routing_load(self) -> LoadStats:
        """Load for the scorer: the last polled figures, less the gateway's requests that finished
        since that poll, and with running at least what the gateway has in flight."""
        running = max(self.load.running - (self.finished - self.finished_at_poll), self.inflight, 0)
        return LoadStats(running, self.load.waiting, self.load.kv_usage)


class ReplicaSet:
    """Polls each replica's /health and /metrics; drops a replica after ``failures_to_drop`` failed
    checks (clearing its index entries) and restores it on its first good check. Replicas may be
    added and removed while it runs (discovery); ``replicas`` is changed in place, never rebound."""

    def __init__(self, replicas: Sequence[Replica], index: KVBlockIndex, client: httpx.AsyncClient,
                 interval_s: float = 1.0, failures_to_drop: int = 2, timeout_s: float = 2.0) -> None:
        self.replicas = list(replicas)
        self._by_name = {r.name: r for r in self.replicas}
        self._index = index
        self._client = client
        self.interval_s = interval_s
        self.failures_to_drop = failures_to_drop
        self.timeout_s = timeout_s

    def get(self, name: str) -> Replica | None:
        """The replica named ``name`` (its URL), or None."""
        return self._by_name.get(name)

    def healthy(self) -> list[Replica]:
        """Replicas that passed their last health check, in configuration order."""
        return [r for r in self.replicas if r.healthy]

    async def run(self) -> None:
        """Check every replica every ``interval_s`` until cancelled. The checks are spread evenly
        over the interval (not one burst per interval), so requests never queue behind a burst of
        polls on the event loop; a check still running is not started again."""
        running: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                replicas = list(self.replicas)          # discovery may change the list meanwhile
                if not replicas:
                    await asyncio.sleep(self.interval_s)
                for replica in replicas:
                    previous = running.get(replica.name)
                    if previous is None or previous.done():
                        running[replica.name] = asyncio.create_task(self.check(replica))
                    await asyncio.sleep(self.interval_s / len(replicas))
                for name in [n for n in running if n not in self._by_name]:
                    running.pop(name).cancel()
        finally:
            for task in running.values():
                task.cancel()

    def add(self, replica: Replica) -> bool:
        """Start checking ``replica`` (not routed to until a check passes); False when one of
        that name is already here."""
        if replica.name in self._by_name:
            return False
        self.replicas.append(replica)
        self._by_name[replica.name] = replica
        return True

    async def remove(self, name: str, why: str) -> Replica | None:
        """Stop checking and routing to the replica named ``name``, forget its blocks and stop its
        event stream; the removed replica, or None when there is none of that name."""
        replica = self._by_name.pop(name, None)
        if replica is None:
            return None
        self.replicas.remove(replica)
        logger.warning("replica %s is removed (%s)", name, why)
        replica.healthy = False
        if replica.ingest is not None:
            await asyncio.to_thread(replica.ingest.close)
            await asyncio.to_thread(replica.ingest.reset)
        else:
            await asyncio.to_thread(self._index.clear_replica, name)
        return replica

    async def check_all(self) -> None:
        """Check every replica once, concurrently."""
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def check(self, replica: Replica) -> None:
        """One health check; on success also refresh the replica's load. Its events endpoint is
        watched too (a warning when it stays silent: ``event_watch``)."""
        if replica.events is not None:
            replica.events.check(time.monotonic(), replica.events_heard())
        try:
            response = await self._client.get(f"{replica.name}/health", timeout=self.timeout_s)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            replica.failures += 1
            if replica.healthy and replica.failures >= self.failures_to_drop:
                await self.mark_down(replica, "failed health checks")
            return
        replica.failures = 0
        if not replica.healthy:
            logger.info("replica %s is up", replica.name)
            replica.healthy = True
        try:
            finished = replica.finished
            metrics = await self._client.get(f"{replica.name}/metrics", timeout=self.timeout_s)
            if metrics.status_code == 200:
                replica.load, replica.finished_at_poll = parse_load(metrics.text), finished
        except httpx.HTTPError:
            # Load stays as last polled; whether the replica is up is the health check's call.
            logger.debug("load poll of %s failed", replica.name)

    async def mark_down(self, replica: Replica, why: str) -> None:
        """Stop routing to ``replica`` and forget its blocks until a health check passes again."""
        if not replica.healthy:
            return
        logger.warning("replica %s is down (%s); its index entries are cleared", replica.name, why)
        replica.healthy = False
        replica.load = LoadStats()
        if replica.ingest is not None:
            await asyncio.to_thread(replica.ingest.reset)
        else:
            await asyncio.to_thread(self._index.clear_replica, replica.name)
