"""KV events -> the index, one subscriber per replica (pyzmq imported lazily, in the thread).

Sequence rules (``ReplicaIngest.on_batch``): batches are applied in sequence order, each once. A
sequence number above the next expected one is a gap: the missed batches are fetched from the
replica's replay socket first. A number at or below the last one *received on the PUB stream* means
the publisher restarted (its sequence starts again at 0): the replica's blocks are forgotten, then
its replay buffer is read from 0. A number at or below the last *applied* one but above the last
received was already applied through replay and is skipped. ``AllBlocksCleared`` forgets the
replica's blocks too.

Keys: a kvhive replica's hashes are kvhive block keys already. A foreign engine (vLLM) names blocks
with its own hashes, so ``BlockKeyMapper`` recomputes kvhive's chain from the token ids of each
``BlockStored`` (continuing from the kvhive key of its parent) and remembers engine hash -> keys.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.kv.events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireHash,
    decode_batch,
    normalize_medium,
)
from kvhive.router.index import KVBlockIndex

logger = logging.getLogger(__name__)

ReplayFetch = Callable[[int], list[tuple[int, bytes]]]


class BlockKeyMapper:
    """A replica's block hashes -> kvhive block keys: identity for kvhive, recomputed for others."""

    def __init__(self, foreign: bool, block_size: int, root: bytes) -> None:
        self.foreign = foreign
        self.block_size = block_size
        self.root = root
        # Foreign only: engine hash -> (kvhive keys of its tokens, media that hold it). An entry
        # lives while any medium holds the block, so a child stored later can find its parent.
        self._keys: dict[WireHash, tuple[tuple[bytes, ...], set[str]]] = {}
        self.num_unmapped = 0

    def __len__(self) -> int:
        return len(self._keys)

    def stored(self, event: BlockStored) -> list[bytes]:
        """Keys of the blocks ``event`` stores (foreign blocks whose chain is unknown are skipped)."""
        if not self.foreign:
            return [h for h in event.block_hashes if isinstance(h, bytes)]
        size = event.block_size
        if size <= 0 or size % self.block_size or len(event.token_ids) < size * len(event.block_hashes):
            self.num_unmapped += len(event.block_hashes)
            return []
        # Only blocks whose extra keys kvhive's hash can express are mapped: the first block that
        # has others, and every block chained after it, is left out of the index (see _salt).
        mappable = len(event.block_hashes)
        salt: str | None = None
        for i in range(len(event.block_hashes)):
            ok, found = _salt(event, i, first=event.parent_block_hash is None and i == 0)
            if not ok:
                mappable = i
                break
            salt = salt if found is None else found
        self.num_unmapped += len(event.block_hashes) - mappable
        if not mappable:
            return []
        if event.parent_block_hash is None:
            parent = self.root
            extra = ExtraKeys(cache_salt=salt, adapter_id=event.lora_name or None)
        else:
            known = self._keys.get(event.parent_block_hash)
            if known is None:           # the parent was stored before we listened, or is gone
                self.num_unmapped += mappable
                return []
            parent, extra = known[0][-1], None
        tokens = event.token_ids[: size * mappable]
        # Passing the parent's key as the root continues its chain: h = H(parent || tokens || extra).
        keys = hash_blocks(tokens, self.block_size, parent, extra)
        per_block = size // self.block_size
        medium = normalize_medium(event.medium)
        for i, engine_hash in enumerate(event.block_hashes[:mappable]):
            entry = self._keys.get(engine_hash)
            media = entry[1] if entry is not None else set()
            media.add(medium)
            self._keys[engine_hash] = (tuple(keys[i * per_block:(i + 1) * per_block]), media)
        return keys

    def removed(self, event: BlockRemoved) -> list[bytes]:
        """Keys of the blocks ``event`` removes from its medium."""
        if not self.foreign:
            return [h for h in event.block_hashes if isinstance(h, bytes)]
        medium = normalize_medium(event.medium)
        keys: list[bytes] = []
        for engine_hash in event.block_hashes:
            entry = self._keys.get(engine_hash)
            if entry is None:
                continue
            keys.extend(entry[0])
            entry[1].discard(medium)
            if not entry[1]:
                del self._keys[engine_hash]
        return keys

    def clear(self) -> None:
        """Forget every mapping (the replica dropped all its blocks)."""
        self._keys.clear()


def _salt(event: BlockStored, i: int, first: bool) -> tuple[bool, str | None]:
    """Whether block ``i`` of a foreign ``event`` maps to a kvhive key, and the cache salt it carries.

    vLLM publishes each block's extra hash keys untagged, in this order: the LoRA name (when
    ``lora_name`` is set), (multimodal id, offset) pairs, the cache salt (block 0 of a request
    only), prompt-embedding digests. kvhive's hash mixes a salt and an adapter id into block 0 and
    has no multimodal or embedding keys: the gateway hashes text prompts, and a placeholder block
    of an image must never look like text the gateway could route by. So a block is mapped when
    its keys are at most the LoRA name and, on the chain's first block, one string: the salt.
    """
    keys = event.extra_keys[i] if event.extra_keys is not None and i < len(event.extra_keys) else None
    if keys is not None and not isinstance(keys, list | tuple):
        return False, None
    rest = list(keys or ())
    if event.lora_name and rest and rest[0] == event.lora_name:
        rest = rest[1:]
    if not rest:
        return True, None
    if first and len(rest) == 1 and isinstance(rest[0], str):
        return True, rest[0]
    return False, None


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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- sequence rules

    def on_batch(self, seq: int, payload: bytes) -> None:
        """Apply one batch received on the PUB stream, replaying or resetting first when needed."""
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
        try:
            self.catch_up()
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                try:
                    self.on_batch(int.from_bytes(frames[1], "big"), frames[2])
                except Exception:  # noqa: BLE001 - one bad batch must not stop the subscriber
                    logger.exception("replica %s: KV-event batch failed", self.replica)
        finally:
            sub.close(linger=0)
            if client is not None:
                client.close()
            ctx.term()


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
