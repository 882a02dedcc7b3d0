"""The worker half of disaggregated serving, wrapped around an optional inner worker.

Prefill role: ``save_kv_layer(layer)`` copies that layer of the step's ``KVSend`` blocks out of the
pool (the forward has just written them) and queues them for the sender thread, which pushes one
frame per layer per step over the direct channel; blocks the decode instance holds are skipped.
Decode role: each ``RemoteLoad`` runs on a loader thread that waits for the transfer layer by
layer (``TransferTable.wait_layer``) and copies each layer into the pool as it lands; the load
reports the leading blocks whose every layer landed. Blocks that did not arrive are taken from the
shared tier when it holds them, else recomputed. ``wait_for_layer_load`` is the inner worker's
(a synchronous tier load in the step).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvhive.connector.base import ConnectorMeta, ConnectorWorker, FinishedTransfers, KVSend, RemoteLoad
from kvhive.connector.disagg.incoming import TransferTable
from kvhive.connector.disagg.transfer_config import KVTransferConfig
from kvhive.connector.disagg.transfer_stats import DisaggCounters, KVTransferStats
from kvhive.connector.disagg.transport import KVSendChannel, TcpReceiver, TcpSendChannel
from kvhive.store.key import KeySpace, StoreKey

logger = logging.getLogger(__name__)


class DisaggWorker:
    """ConnectorWorker for ``--kv-role prefill|decode`` over an optional inner worker."""

    def __init__(self, config: KVTransferConfig, key_space: KeySpace, num_layers: int,
                 inner: ConnectorWorker | None = None,
                 held_blocks: Callable[[list[bytes]], int] | None = None,
                 shared_tier: Callable[[StoreKey], Any] | None = None,
                 channel: Callable[[tuple[str, int]], KVSendChannel] | None = None) -> None:
        """``held_blocks``: leading blocks the decode pool holds; ``shared_tier``: a whole block's
        payload from the shared store (or None); ``channel``: opens a send channel to an endpoint."""
        self.config, self.key_space, self.num_layers, self.inner = config, key_space, num_layers, inner
        self.shared_tier = shared_tier
        self.counters = DisaggCounters(config.role)
        self._kv: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._done_recving: dict[str, int] = {}
        self._cancelled: set[str] = set()
        self._step_sends: tuple[KVSend, ...] = ()
        self._layers_saved = 0
        self._channel = channel or (lambda ep: TcpSendChannel(ep, key_space, num_layers, config.timeout_s))
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._sender = self._loaders = self.receiver = self.table = None
        if config.role == "prefill":
            self._sender = threading.Thread(target=self._send_loop, name="kvhive-kv-send", daemon=True)
            self._sender.start()
        elif config.role == "decode":
            self.table = TransferTable(num_layers, config.buffer_bytes, config.unclaimed_ttl_s)
            self.receiver = TcpReceiver(config.host, config.port, key_space, self.table, config.timeout_s,
                                        held_blocks or (lambda hashes: 0))
            self._loaders = ThreadPoolExecutor(4, thread_name_prefix="kvhive-kv-remote")
            logger.info("KV transfer endpoint listening on %s:%d", config.host, self.receiver.port)

    # ------------------------------------------------------------------ the worker interface

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Remember the pool (and hand it to the inner worker)."""
        self._kv = kv_cache
        if self.inner is not None:
            self.inner.register_kv_caches(kv_cache)

    def register_window_cache(self, window_cache: torch.Tensor, window_layers: tuple[bool, ...]) -> None:
        """Refused: a disaggregating engine keeps every layer in one pool (sends are whole blocks)."""
        raise ValueError("disaggregated serving keeps every layer in one pool: no window pool")

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start the inner transfers, this step's remote loads, and note its sends."""
        if self.inner is not None:
            self.inner.start_load_kv(meta)
        for sent in self._step_sends if self._layers_saved < self.num_layers else ():
            self._queue.put(("abort", sent.transfer_id))        # the previous step broke off
        self._step_sends, self._layers_saved = tuple(s for s in meta.kv_sends), 0
        for transfer_id in meta.ended_sends:
            self._queue.put(("abort", transfer_id))
        with self._lock:
            self._cancelled.update(meta.cancelled_loads)
        for load in meta.remote_loads:
            self._loaders.submit(self._load, load)

    def wait_for_layer_load(self, layer: int) -> None:
        """The inner worker's synchronous loads of this layer."""
        if self.inner is not None:
            self.inner.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        """Copy layer ``layer`` of this step's send blocks out of the pool and queue it."""
        if self.inner is not None:
            self.inner.save_kv_layer(layer)
        for send in self._step_sends:
            if send.block_ids:
                ids = torch.tensor(send.block_ids, device=self._kv.device)
                snapshot = self._kv[ids, layer].cpu()       # [n, 2, block_size, kv_heads, head_dim]
                self._queue.put(("layer", send, layer, snapshot))
            if send.last and layer == self.num_layers - 1:
                self._queue.put(("end", send.transfer_id, len(send.block_hashes)))
        self._layers_saved = layer + 1

    def wait_for_save(self) -> None:
        """The inner worker's saves (sends are not waited for: the decode side has a deadline)."""
        if self.inner is not None:
            self.inner.wait_for_save()

    def get_finished(self, finished_request_ids: Sequence[str]) -> FinishedTransfers:
        """The inner worker's finished transfers plus the remote loads that ended."""
        inner = (self.inner.get_finished(finished_request_ids) if self.inner is not None
                 else FinishedTransfers(set(), {}))
        with self._lock:
            done, self._done_recving = self._done_recving, {}
        if not done:
            return inner
        return FinishedTransfers(inner.done_sending, {**inner.done_recving, **done})

    def stats(self) -> KVTransferStats:
        """This instance's transfer counters (any thread)."""
        rx = self.receiver
        return self.counters.snapshot(0 if rx is None else rx.received_bytes, 0 if rx is None else rx.failed_transfers)

    def close(self) -> None:
        """Stop the sender, the loaders and the endpoint."""
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=5)
        if self._loaders is not None:
            with self._lock:
                self._cancelled.add("*")
            self._loaders.shutdown(wait=True)
        if self.receiver is not None:
            self.receiver.close()

    # ------------------------------------------------------------------ prefill: the sender

    def _send_loop(self) -> None:
        """Open a channel per transfer at its first frame and push frames in order."""
        channels: dict[str, tuple[KVSendChannel, int] | None] = {}     # None: this transfer failed
        while (item := self._queue.get()) is not None:
            kind, transfer_id = item[0], item[1].transfer_id if item[0] == "layer" else item[1]
            try:
                if kind == "layer":
                    self._send_layer(channels, *item[1:])
                elif kind in ("end", "abort") and channels.get(transfer_id) is not None:
                    channel, _ = channels.pop(transfer_id)
                    channel.end(item[2]) if kind == "end" else channel.close()
                else:
                    channels.pop(transfer_id, None)
            except (OSError, ConnectionError) as exc:
                logger.warning("KV transfer %s to the decode instance failed: %s", transfer_id, exc)
                self.counters.send_failures += 1
                entry = channels.get(transfer_id)
                if entry is not None:
                    entry[0].close()
                channels[transfer_id] = None
                if kind != "layer":
                    channels.pop(transfer_id, None)

    def _send_layer(self, channels: dict, send: KVSend, layer: int, snapshot: torch.Tensor) -> None:
        """One layer frame of ``send``'s blocks (minus those the decode side holds)."""
        if send.transfer_id not in channels:
            channel = self._channel(send.endpoint)
            channels[send.transfer_id] = None
            skip = channel.open(send.transfer_id, list(send.block_hashes))
            channels[send.transfer_id] = (channel, skip)
            self.counters.skipped_blocks += skip
        entry = channels[send.transfer_id]
        if entry is None:
            return
        channel, skip = entry
        start = max(skip - send.first_block, 0)
        n = len(send.block_ids)
        if start >= n:
            return
        started = time.perf_counter()
        hashes = send.block_hashes[send.first_block + start:send.first_block + n]
        raw = snapshot[start:n].contiguous().view(torch.uint8).reshape(n - start, -1).numpy()
        channel.send_layer(layer, send.first_block + start, self.key_space.keys(hashes), [memoryview(r) for r in raw])
        self.counters.note_sent(raw.nbytes, (n - start) if layer == self.num_layers - 1 else 0,
                                time.perf_counter() - started)

    # ------------------------------------------------------------------ decode: the loaders

    def _load(self, load: RemoteLoad) -> None:
        """Wait for the transfer layer by layer, copying each into the pool; report intact blocks."""
        started, intact = time.perf_counter(), 0
        try:
            intact = self._receive(load)
            if intact < len(load.block_ids):
                intact += self._from_shared_tier(load, intact)
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never fatal
            logger.exception("remote KV load for %s failed", load.request_id)
            intact = 0
        self.counters.note_load(len(load.block_ids), intact, time.perf_counter() - started)
        with self._lock:
            self._done_recving[load.request_id] = intact
            self._cancelled.discard(load.request_id)

    def _receive(self, load: RemoteLoad) -> int:
        """Copy the transfer's layers into the pool as they land; the leading blocks that got all."""
        table, first, n = self.table, load.first_block, len(load.block_ids)
        transfer = table.claim(load.transfer_id)
        cancelled = self._cancel_check(load.request_id)
        complete = [True] * n
        waiting = True
        try:
            for layer in range(self.num_layers):
                if waiting:
                    waiting = table.wait_layer(transfer, layer, first, n, self.config.timeout_s, cancelled)
                with table.cond:
                    got = dict(transfer.layers[layer])
                for i, block_id in enumerate(load.block_ids):
                    block = got.get(first + i)
                    if block is None:
                        complete[i] = False
                    elif complete[i]:
                        self._kv[block_id, layer].copy_(self._as_layer(block))
            # Only blocks of this request's own prompt count: a transfer of another prompt (a
            # client that sent the decode request a different prompt) agrees up to where they part.
            sent = transfer.hashes[first:first + n]
            agree = next((i for i, (a, b) in enumerate(zip(sent, load.block_hashes, strict=False)) if a != b),
                         min(len(sent), n))
        finally:
            if transfer.error:
                logger.warning("KV transfer %s: %s", load.transfer_id, transfer.error)
            table.release(transfer)
        return min(complete.index(False) if False in complete else n, agree)

    def _from_shared_tier(self, load: RemoteLoad, intact: int) -> int:
        """Blocks after the first ``intact`` that the shared tier holds, in order; how many."""
        if self.shared_tier is None:
            return 0
        found = 0
        block_bytes = self._kv[0].numel() * self._kv.element_size()
        for block_id, block_hash in zip(load.block_ids[intact:], load.block_hashes[intact:], strict=True):
            payload = self.shared_tier(self.key_space.key(block_hash))
            if payload is None or memoryview(payload).nbytes != block_bytes:
                break
            flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._kv.dtype)
            self._kv[block_id].copy_(flat.view(self._kv[block_id].shape))
            found += 1
        self.counters.fallback_blocks += found
        return found

    def _as_layer(self, block: memoryview) -> torch.Tensor:
        """One block's layer record as a tensor shaped like ``kv[block, layer]``."""
        shape = self._kv.shape[2:]
        return torch.frombuffer(block, dtype=torch.uint8).view(self._kv.dtype).view(shape)

    def _cancel_check(self, request_id: str) -> Callable[[], bool]:
        def cancelled() -> bool:
            return request_id in self._cancelled or "*" in self._cancelled
        return cancelled
