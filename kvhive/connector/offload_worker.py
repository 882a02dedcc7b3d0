"""The offload connector's worker half: moves block bytes between the KV pool and a TieredStore.

Threads (none of them is the engine loop):

- the writer: takes snapshots of saved blocks (one ``index_select`` copy of their pool rows,
  made by ``start_load_kv`` before the step's forward can overwrite anything: a block freed by a
  finished request is reallocated only by a later ``schedule()``, whose step starts with this
  snapshot) and puts them into the store, block by block;
- the layer loader: copies a step's synchronous loads (payloads already in hand) into the pool
  one layer at a time and sets that layer's event, so layer l computes while layer l+1 loads;
- the fetchers: fetch an asynchronous load's objects from the store (slow tiers; hits are
  promoted), check their size, and copy each block whole into its pool block. The first missing
  or bad object ends the load: the blocks before it are reported loaded, the rest recomputed.
  A load cancelled by a later step (its request was aborted) ends at its next block the same way.

Block bytes are the pool rows verbatim (no pickle, one copy each way), so a block of any dtype
round-trips exactly. With a window pool a block's global layers come from the main pool and its
window layers from the window pool, interleaved in layer order (``kvhive.connector.pool_blocks``):
the objects are byte for byte those of a one-pool engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvhive.connector.base import ConnectorMeta, FinishedTransfers, LoadSpec
from kvhive.connector.pool_blocks import PoolBlocks
from kvhive.store.key import StoreKey
from kvhive.store.tiered import TieredStore

logger = logging.getLogger(__name__)
DEFAULT_MAX_PENDING_SAVE_BYTES = 1 << 30


class OffloadWorker:
    """Worker half of the offload connector over a TieredStore."""

    def __init__(self, store: TieredStore, max_pending_save_bytes: int = DEFAULT_MAX_PENDING_SAVE_BYTES,
                 num_fetch_threads: int = 2) -> None:
        self.store = store
        self.max_pending_save_bytes = max_pending_save_bytes
        self._blocks: PoolBlocks | None = None
        self._lock = threading.Lock()
        self._done_recving: dict[str, int] = {}
        self._fetching: set[str] = set()        # requests whose async load is queued or running
        self._cancelled: set[str] = set()       # of those, the ones to stop at the next block
        self._pending_save_bytes = 0            # snapshot bytes queued, not yet written
        # Keys queued for the writer and not yet put (a count: a block may be queued twice).
        self._unsaved: dict[StoreKey, int] = {}
        self.dropped_save_blocks = 0            # saves skipped because the writer fell behind
        self.failed_load_blocks = 0             # async-load blocks missing or bad (recomputed)
        self.async_load_seconds = 0.0           # summed wall time of finished async loads
        self.async_load_count = 0
        self._saves: queue.Queue[tuple[list[StoreKey], torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvhive-kv-writer", daemon=True)
        self._writer.start()
        self._fetchers = ThreadPoolExecutor(num_fetch_threads, thread_name_prefix="kvhive-kv-fetch")
        self._layer_loader = ThreadPoolExecutor(1, thread_name_prefix="kvhive-kv-layers")
        # This step's synchronous load: one event per layer, set once that layer is in the pool.
        self._layer_events: list[threading.Event] | None = None
        self._layer_load: Future | None = None
        self._closed = False

    # ------------------------------------------------------------------ the worker interface

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Remember the pool; a block is ``kv_cache[block_id]``, contiguous across all layers."""
        self._blocks = PoolBlocks(kv_cache)

    def register_window_cache(self, window_cache: torch.Tensor, window_layers: tuple[bool, ...]) -> None:
        """Remember the window layers' pool: objects still hold every layer (``PoolBlocks``)."""
        self._blocks.add_window_pool(window_cache, window_layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one store object's payload (one block of every layer)."""
        return self._blocks.block_bytes

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Snapshot this step's saves first, then start its loads (sync: layer by layer; async: fetch)."""
        self._finish_layer_load()
        if meta.saves:
            self._snapshot(meta.saves, meta.save_window_ids)
        with self._lock:      # cancels name loads of earlier steps: apply them before new loads
            self._cancelled.update(self._fetching.intersection(meta.cancelled_loads))
            self._fetching.update(spec.request_id for spec in meta.loads if spec.is_async)
        sync = [spec for spec in meta.loads if not spec.is_async]
        for spec in meta.loads:
            if spec.is_async:
                self._fetchers.submit(self._fetch, spec)
        if sync:
            events = [threading.Event() for _ in range(self._blocks.num_layers)]
            self._layer_events = events
            self._layer_load = self._layer_loader.submit(self._copy_layers, sync, events)

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until layer ``layer`` of this step's synchronous loads is in the pool."""
        events = self._layer_events
        if events is None:
            return
        events[layer].wait()
        if layer == len(events) - 1:
            self._finish_layer_load()

    def save_kv_layer(self, layer: int) -> None:
        """Nothing per layer: saves copy whole blocks once they are full (see the module docstring)."""

    def wait_for_save(self) -> None:
        """Block until every snapshot handed to the writer is in the store."""
        self._saves.join()

    def is_saving(self, keys: Sequence[StoreKey]) -> bool:
        """Whether a save of any of these blocks is queued or being written (any thread)."""
        with self._lock:
            return any(key in self._unsaved for key in keys)

    def get_finished(self, finished_request_ids: Sequence[str]) -> FinishedTransfers:
        """Asynchronous loads completed since the last call; saves never hold blocks (empty set)."""
        with self._lock:
            done, self._done_recving = self._done_recving, {}
        return FinishedTransfers(set(), done)

    def close(self) -> None:
        """Finish pending loads and saves, then stop the threads (the store stays open)."""
        if self._closed:
            return
        self._closed = True
        self._finish_layer_load()
        self._fetchers.shutdown(wait=True)
        self._layer_loader.shutdown(wait=True)
        self._saves.put(None)
        self._writer.join()

    # ------------------------------------------------------------------ saves

    def _snapshot(self, saves: Sequence[tuple[int, StoreKey]], window_ids: Sequence[int]) -> None:
        """Copy the saved blocks out of the pool (with a window pool: their window parts from
        ``window_ids``, interleaved in layer order) and queue them for the writer."""
        nbytes = len(saves) * self.block_bytes
        with self._lock:
            if self._pending_save_bytes + nbytes > self.max_pending_save_bytes:
                self.dropped_save_blocks += len(saves)
                logger.warning("KV writer is behind (%d bytes queued): %d blocks not saved",
                               self._pending_save_bytes, len(saves))
                return
            self._pending_save_bytes += nbytes
            for _, key in saves:
                self._unsaved[key] = self._unsaved.get(key, 0) + 1
        with torch.inference_mode():
            snapshot = self._blocks.gather([block_id for block_id, _ in saves], window_ids).cpu()
        self._saves.put(([key for _, key in saves], snapshot))

    def _write_loop(self) -> None:
        while True:
            item = self._saves.get()
            unsaved: list[StoreKey] = [] if item is None else list(item[0])   # in order, not yet put
            try:
                if item is None:
                    return
                keys, snapshot = item
                rows = snapshot.view(torch.uint8).reshape(len(keys), -1).numpy()
                for key, row in zip(keys, rows, strict=True):
                    try:
                        self.store.put(key, row)
                    finally:
                        unsaved.pop(0)
                        self._saved(key)
            except Exception:  # noqa: BLE001 - the writer must outlive any one bad save
                logger.exception("KV writer: saving blocks failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending_save_bytes -= item[1].nbytes
                        for key in unsaved:          # the ones a failure skipped
                            self._drop_unsaved(key)
                self._saves.task_done()

    def _saved(self, key: StoreKey) -> None:
        with self._lock:
            self._drop_unsaved(key)

    def _drop_unsaved(self, key: StoreKey) -> None:
        # Lock held.
        count = self._unsaved.get(key, 0) - 1
        if count > 0:
            self._unsaved[key] = count
        else:
            self._unsaved.pop(key, None)

    # ------------------------------------------------------------------ loads

    def _copy_layers(self, specs: list[LoadSpec], events: list[threading.Event]) -> None:
        """Stage every payload once, then copy one layer of all blocks at a time."""
        pools, kv = self._blocks, self._blocks.kv
        try:
            payloads = [p for spec in specs for p in spec.payloads]
            targets = pools.load_targets([b for spec in specs for b in spec.block_ids], _window_ids(specs))
            staging = torch.empty((len(payloads), self.block_bytes), dtype=torch.uint8,
                                  pin_memory=kv.is_cuda)
            rows = staging.numpy()
            for i, payload in enumerate(payloads):
                rows[i] = np.frombuffer(payload, dtype=np.uint8)
            blocks = staging.view(kv.dtype).view(len(payloads), pools.num_layers, *kv.shape[2:])
            with torch.inference_mode():
                for layer, event in enumerate(events):
                    pools.copy_layer(layer, blocks[:, layer].to(kv.device, non_blocking=True), targets)
                    if kv.is_cuda:
                        torch.cuda.current_stream(kv.device).synchronize()
                    event.set()
        finally:
            for event in events:   # on failure the step still ends; _finish_layer_load re-raises
                event.set()

    def _finish_layer_load(self) -> None:
        """Wait for this step's layer loader; re-raise its failure (never compute on partial KV)."""
        load, self._layer_load, self._layer_events = self._layer_load, None, None
        if load is not None:
            load.result()

    def _fetch(self, spec: LoadSpec) -> None:
        """Fetch and copy an asynchronous load's blocks in order, stopping at the first bad one."""
        num_loaded = 0
        cancelled = False
        start = time.perf_counter()
        try:
            window_ids = spec.window_block_ids or (0,) * len(spec.block_ids)
            for block_id, window_id, key in zip(spec.block_ids, window_ids, spec.keys, strict=True):
                if spec.request_id in self._cancelled:
                    cancelled = True
                    break
                payload = self.store.get(key)
                if payload is None or memoryview(payload).nbytes != self.block_bytes:
                    break
                self._blocks.write_block(block_id, window_id, payload)
                num_loaded += 1
        except Exception:  # noqa: BLE001 - a failed load is a partial hit, never a dead engine
            logger.exception("KV fetch for request %s failed after %d blocks", spec.request_id, num_loaded)
        if cancelled:
            logger.info("KV load for request %s cancelled after %d of %d blocks",
                        spec.request_id, num_loaded, len(spec.keys))
        elif num_loaded < len(spec.keys):
            logger.info("KV load for request %s: %d of %d blocks; recomputing the rest",
                        spec.request_id, num_loaded, len(spec.keys))
        with self._lock:
            self._fetching.discard(spec.request_id)
            self._cancelled.discard(spec.request_id)
            if not cancelled:
                self.failed_load_blocks += len(spec.keys) - num_loaded
            self.async_load_seconds += time.perf_counter() - start
            self.async_load_count += 1
            self._done_recving[spec.request_id] = num_loaded


def _window_ids(specs: Sequence[LoadSpec]) -> list[int] | None:
    """The loads' window entries in block order; None when they have none (one pool)."""
    if all(spec.window_block_ids is None for spec in specs):
        return None
    return [w for spec in specs for w in spec.window_block_ids or (0,) * len(spec.block_ids)]
