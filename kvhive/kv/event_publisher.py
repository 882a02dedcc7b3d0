"""The ZMQ publisher of a replica's KV events (``KVEventPublisher``), in the wire format of
``kvhive.core.kv_events`` (frames, replay protocol and encoding are described there); pyzmq is
imported lazily, in the constructor."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvhive.core.kv_events import (
    END_OF_REPLAY,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WireHash,
    encode_batch,
)
from kvhive.core.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)


_STOP = object()


class KVEventPublisher:
    """Publishes EventBatches on a ZMQ PUB socket from a background thread, with optional replay.

    ``publish`` only enqueues (from any thread), so the engine loop never waits on the network. The
    thread owns both sockets; sequence numbers start at 0 and grow by one per batch sent. The last
    ``buffer_steps`` batches are kept for replay; ``hwm`` is the PUB socket's high-water mark. An
    endpoint with ``*`` (or ipc/inproc) is bound, else connected. Every batch carries
    ``data_parallel_rank``, as vLLM's publisher stamps it.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 topic: bytes = b"", buffer_steps: int = 10_000, as_map: bool = True,
                 max_queue: int = 100_000, data_parallel_rank: int | None = 0, hwm: int = 100_000,
                 int_hashes: bool = False) -> None:
        import zmq  # optional dependency: only publishers and subscribers need it

        self._zmq = zmq
        self.topic = topic
        self._as_map = as_map
        self._int_hashes = int_hashes
        self._hwm = hwm
        self._rank = data_parallel_rank
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # Set by the thread once bound: the actual addresses (a "*" port resolved).
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch; never blocks. When the queue is full the batch is dropped and counted."""
        if self._closed or not events:
            return
        try:
            self._queue.put_nowait(EventBatch(time.time(), list(events), self._rank))
        except queue.Full:
            self.num_dropped += 1

    def publish_stored(self, block_hashes: Sequence[WireHash], parent: WireHash | None,
                       token_ids: Sequence[int], block_size: int, medium: str = MEDIUM_GPU) -> None:
        """Queue one BlockStored batch (blocks of one chain, in order, after ``parent``)."""
        self.publish([BlockStored(list(block_hashes), parent, list(token_ids), block_size, None, medium)])

    def publish_removed(self, block_hashes: Sequence[WireHash], medium: str = MEDIUM_GPU) -> None:
        """Queue one BlockRemoved batch."""
        self.publish([BlockRemoved(list(block_hashes), medium)])

    def publish_cleared(self) -> None:
        """Queue one AllBlocksCleared batch."""
        self.publish([AllBlocksCleared()])

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            _bind_or_connect(pub, self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.endpoint
            replay = None
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor, which raises it
            self._error = exc
            ctx.destroy(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=0)
            ctx.term()

    def _loop(self, pub: Any, replay: Any) -> None:
        while True:
            if replay is not None:
                while replay.poll(0):
                    self._serve_replay(replay)
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            seq = self._next_seq
            self._next_seq += 1
            payload = encode_batch(item, self._as_map, self._int_hashes)
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        # [identity, b"", start] from REQ/DEALER clients that send the empty delimiter, as vLLM's do.
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        identity, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


def _bind_or_connect(socket: Any, endpoint: str) -> None:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to a concrete host."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def open_publisher(config: KVEventsConfig, model: str) -> KVEventPublisher:
    """A started KVEventPublisher for ``config`` (an active one) on the topic rendered for ``model``."""
    return KVEventPublisher(config.endpoint, config.replay_endpoint, topic=config.rendered_topic(model).encode(),
                            buffer_steps=config.buffer_steps, as_map=config.as_map,
                            max_queue=config.max_queue_size, data_parallel_rank=config.data_parallel_rank,
                            hwm=config.hwm, int_hashes=config.int_hashes)
