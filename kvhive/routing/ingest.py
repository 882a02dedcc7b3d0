"""KV events -> the index, one subscriber per replica (pyzmq imported lazily, in the thread).

Sequence rules (``ReplicaIngest.on_batch``): batches are applied in sequence order, each once. A
sequence number above the next expected one is a gap: the missed batches are fetched from the
replica's replay socket first. A number at or below the last one *received on the PUB stream* means
the publisher restarted (its sequence starts again at 0): the replica's blocks are forgotten, then
its replay buffer is read from 0. A number at or below the last *applied* one but above the last
received was already applied through replay and is skipped. ``AllBlocksCleared`` forgets the
replica's blocks too, in every medium (a replica whose prefix cache was reset then states again, in
the same batch, every block it still holds). When the subscription connects again after losing the
publisher, the replica may have restarted and sent more batches than before while nobody listened
(so neither rule would see it): its blocks are forgotten and its replay buffer read from 0
(``on_reconnect``).

Keys: ``BlockKeyMapper`` (``block_keys.py``) turns the replica's block hashes into kvhive block keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhive.core.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    normalize_medium,
)
from kvhive.routing.block_keys import BlockKeyMapper
from kvhive.routing.index import KVBlockIndex

logger = logging.getLogger(__name__)

ReplayFetch = Callable[[int], list[tuple[int, bytes]]]


@dataclass
class IngestStats:
    """Counters of one replica's event stream (cumulative)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    resets: int = 0
    decode_errors: int = 0


class ReplicaIngest:
    """Keeps the index in step with one replica's KV events (see the module docstring for the rules)."""

    def __init__(self, replica: str, index: KVBlockIndex, mapper: BlockKeyMapper,
                 endpoint: str | None = None, replay_endpoint: str | None = None,
                 topic: bytes = b"", replay_timeout_s: float = 1.0,
                 replay: ReplayFetch | None = None) -> None:
        self.replica = replica
        self.index = index
        self.mapper = mapper
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.stats = IngestStats()
        self._fetch = replay        # set by the thread when a replay endpoint is given
        # _lock guards the sequence state and orders index updates of this replica.
        self._lock = threading.Lock()
        self.last_applied: int | None = None
        self._last_received: int | None = None
        # time.monotonic() of the last message on the PUB stream since the subscription (re)started.
        self.received_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- sequence rules

    def on_batch(self, seq: int, payload: bytes) -> None:
        """Apply one batch received on the PUB stream, replaying or resetting first when needed."""
        self.received_at = time.monotonic()
        with self._lock:
            if self._last_received is not None and seq <= self._last_received:
                logger.info("replica %s: KV-event sequence went back (%d -> %d); it restarted",
                            self.replica, self._last_received, seq)
                self.stats.resets += 1
                self._forget()
            self._last_received = seq
            if self.last_applied is not None and seq <= self.last_applied:
                return                                      # already applied through replay
            expected = 0 if self.last_applied is None else self.last_applied + 1
            if seq > expected:
                self.stats.gaps += 1
                self.stats.lost += seq - expected - self._replay(expected, until=seq)
            self._apply_payload(seq, payload)

    def catch_up(self) -> None:
        """Apply the replica's whole replay buffer (at start, so blocks stored earlier are known)."""
        with self._lock:
            if self.last_applied is None:
                self._replay(0, until=None)

    def reset(self) -> None:
        """Forget the replica's blocks and sequence (it is gone; its next life starts fresh)."""
        with self._lock:
            self._forget()
            self._last_received = None
            self.received_at = None

    def on_reconnect(self) -> None:
        """The publisher is back after a disconnect: start over from its replay buffer (a restarted
        replica's stream begins there with AllBlocksCleared; one that only lost the connection gives
        its buffered batches again, and blocks stored before its buffer's start are forgotten)."""
        logger.info("replica %s: KV-event publisher reconnected; reading its replay buffer again", self.replica)
        self.stats.resets += 1
        self.reset()
        self.catch_up()

    def apply(self, batch: EventBatch) -> None:
        """Apply the events of one batch to the index, in order."""
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                keys = self.mapper.stored(event)
                if keys:
                    self.index.add(keys, self.replica, normalize_medium(event.medium))
            elif isinstance(event, BlockRemoved):
                keys = self.mapper.removed(event)
                if keys:
                    self.index.remove(keys, self.replica, normalize_medium(event.medium))
            elif isinstance(event, AllBlocksCleared):
                self._forget_blocks()

    def _replay(self, start: int, until: int | None) -> int:
        """Apply buffered batches with start <= seq < until, in order; returns how many."""
        if self._fetch is None:
            return 0
        try:
            batches = self._fetch(start)
        except Exception:  # noqa: BLE001 - a failed replay only leaves a gap
            logger.exception("replica %s: KV-event replay from %d failed", self.replica, start)
            return 0
        applied = 0
        for seq, payload in batches:
            newer = self.last_applied is None or seq > self.last_applied
            if seq >= start and newer and (until is None or seq < until):
                applied += 1
                self._apply_payload(seq, payload)
        self.stats.replayed += applied
        return applied

    def _apply_payload(self, seq: int, payload: bytes) -> None:
        self.last_applied = seq
        self.stats.batches += 1
        try:
            batch = decode_batch(payload)
        except ValueError:
            self.stats.decode_errors += 1
            logger.warning("replica %s: undecodable KV-event batch %d", self.replica, seq)
            return
        try:
            self.apply(batch)
        except Exception:  # noqa: BLE001 - e.g. Redis down: this batch is lost, the stream goes on
            self.stats.lost += 1
            logger.exception("replica %s: applying KV-event batch %d failed", self.replica, seq)

    def _forget(self) -> None:
        self._forget_blocks()
        self.last_applied = None

    def _forget_blocks(self) -> None:
        self.mapper.clear()
        self.index.clear_replica(self.replica)

    # ---------------------------------------------------------------- the subscriber thread

    def start(self) -> None:
        """Subscribe in a background thread (nothing to do without an events endpoint)."""
        if self.endpoint is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"kv-ingest-{self.replica}", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close its sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        import zmq  # optional dependency: only subscribers and publishers need it

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.endpoint)
        client = _ReplayClient(ctx, self.replay_endpoint, self.replay_timeout_s) \
            if self.replay_endpoint else None
        if client is not None and self._fetch is None:
            self._fetch = client.fetch
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            self.catch_up()
            lost = False
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    lost = self._connection_event(monitor, lost)
                if sub in ready:
                    self._receive(sub)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if client is not None:
                client.close()
            ctx.term()


    def _connection_event(self, monitor: Any, lost: bool) -> bool:
        """Handle one SUB connection event; returns whether the publisher is lost (disconnected)."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            return True
        if event == zmq.EVENT_CONNECTED and lost:
            self.on_reconnect()
            return False
        return lost

    def _receive(self, sub: Any) -> None:
        """Apply one message of the PUB stream (frames: topic, 8-byte sequence, payload)."""
        frames = sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        try:
            self.on_batch(int.from_bytes(frames[1], "big"), frames[2])
        except Exception:  # noqa: BLE001 - one bad batch must not stop the subscriber
            logger.exception("replica %s: KV-event batch failed", self.replica)


class _ReplayClient:
    """Asks a replay ROUTER socket for batches from a sequence number on (DEALER, vLLM's framing)."""

    def __init__(self, ctx: Any, endpoint: str, timeout_s: float) -> None:
        self._ctx, self._endpoint, self._timeout_ms = ctx, endpoint, int(timeout_s * 1000)
        self._socket: Any = None

    def fetch(self, start: int) -> list[tuple[int, bytes]]:
        """Buffered batches with seq >= start, in order; [] when the replica does not answer."""
        import zmq

        if self._socket is None:
            self._socket = self._ctx.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._endpoint)
        self._socket.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes]] = []
        while True:
            if not self._socket.poll(self._timeout_ms):
                # No end marker: drop the socket so late answers cannot mix into the next request.
                self.close()
                return out
            frames = self._socket.recv_multipart()
            if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))

    def close(self) -> None:
        """Close the socket (a later fetch opens a new one)."""
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
