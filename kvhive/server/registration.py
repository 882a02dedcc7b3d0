"""``kvhive serve --register``: this replica's heartbeat in the registry that gateways discover
replicas from (layout: ``kvhive.core.replica_registry``).

A background thread writes the replica's record with an expiry of the TTL, now and every TTL / 3;
a stopped process stops beating and its record expires. On a clean shutdown the record is marked
``leaving`` (gateways drop the replica at their next poll) and expires a TTL later. A Redis that
cannot be reached costs a warning and the next beat tries again; a Redis that lost its data
(FLUSHALL, a restart) has the record and the membership back at the next beat.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any

from kvhive.core.replica_registry import MEMBERS_KEY, RegistrationConfig, ReplicaRecord, record_key

if TYPE_CHECKING:
    from kvhive.config import EngineConfig

logger = logging.getLogger(__name__)


class ReplicaHeartbeat:
    """Keeps ``record`` in the registry at ``config.redis_url`` from a daemon thread."""

    def __init__(self, config: RegistrationConfig, record: ReplicaRecord, client: Any = None) -> None:
        self.config = config
        self.record = record
        if client is None:
            import redis  # optional dependency: only registration needs it here
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # A beat that cannot finish within a heartbeat is abandoned; the next one retries.
            timeout = min(2.0, config.heartbeat_s)
            client = redis.Redis.from_url(config.redis_url, socket_timeout=timeout,
                                          socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0))
        self._redis = client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.num_beats = 0              # beats that reached Redis

    def beat(self, leaving: bool = False) -> bool:
        """Write the record (marked ``leaving`` when asked) with its TTL and add it to the members;
        False when Redis could not be reached."""
        record = dataclasses.replace(self.record, leaving=leaving)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(record_key(record.url), record.encode(), px=int(self.config.ttl_s * 1000))
            pipe.sadd(MEMBERS_KEY, record.url)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: the next beat retries
            if not self._failing:
                logger.warning("registry %s unreachable (%s: %s); retrying every %.1f s",
                               self.config.redis_url, type(exc).__name__, exc, self.config.heartbeat_s)
            self._failing = True
            return False
        if self._failing:
            logger.warning("registry %s reachable again; %s is registered", self.config.redis_url,
                           record.url)
        self._failing = False
        self.num_beats += 1
        return True

    def start(self) -> None:
        """Register now, then beat every ``heartbeat_s`` on a daemon thread."""
        if self._thread is not None:
            return
        if self.beat():
            logger.info("registered %s in %s (TTL %.1f s)", self.record.url, self.config.redis_url,
                        self.config.ttl_s)
        self._thread = threading.Thread(target=self._run, name="kvhive-registration", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            self.beat()

    def stop(self, deregister: bool = True) -> None:
        """Stop beating; with ``deregister``, mark the record as leaving so gateways drop this
        replica at their next poll instead of a TTL later."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if deregister and self.beat(leaving=True):
            logger.info("deregistered %s", self.record.url)
        self._redis.close()


def start_heartbeat(registration: RegistrationConfig, config: EngineConfig, fingerprint: str) -> ReplicaHeartbeat:
    """Register the replica that ``config`` describes (its KV-event sockets, if it publishes, so a
    gateway subscribes to them) and keep it registered; the caller stops the returned heartbeat."""
    events = config.kv_events_settings()
    publishing = events is not None and events.active
    record = registration.record(events.endpoint if publishing else None,
                                 events.replay_endpoint if publishing else None, fingerprint)
    heartbeat = ReplicaHeartbeat(registration, record)
    heartbeat.start()
    return heartbeat
