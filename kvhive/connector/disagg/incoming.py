"""The decode side's table of incoming transfers: which layers of which blocks have landed.

A transfer is created by whichever comes first: the prefill's hello (``open``) or the decode
request claiming it (``claim``). Its states: ``waiting`` (claimed, no hello yet) -> ``open``
(blocks arriving) -> ``ended`` (the prefill sent every block) or ``failed`` (the stream broke,
a block failed its checks, it stayed silent past the deadline, or the buffer was full). A
failed transfer never hands out a block: the decode side recomputes what it lacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Transfer:
    """One request's incoming KV: per layer, the blocks (by index in the prompt) that landed."""

    transfer_id: str
    num_layers: int
    hashes: list[bytes] = field(default_factory=list)
    first_sent: int = 0                 # blocks before this one the decode side already held
    state: str = "waiting"
    error: str | None = None
    nbytes: int = 0
    claimed: bool = False
    updated: float = field(default_factory=time.monotonic)
    layers: list[dict[int, memoryview]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = [{} for _ in range(self.num_layers)]

    def has_layer(self, layer: int, first: int, count: int) -> bool:
        """True when layer ``layer`` of blocks [first, first + count) has landed."""
        got = self.layers[layer]
        return all(b in got for b in range(first, first + count))


class TransferTable:
    """Incoming transfers by id, with a byte budget and a time limit for unclaimed ones."""

    def __init__(self, num_layers: int, buffer_bytes: int, unclaimed_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_layers = num_layers
        self.buffer_bytes = buffer_bytes
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.clock = clock
        self.cond = threading.Condition()
        self._transfers: dict[str, Transfer] = {}
        self._nbytes = 0

    def open(self, transfer_id: str, hashes: list[bytes], first_sent: int) -> Transfer | None:
        """Start receiving (the prefill's hello); None when that id is already receiving."""
        with self.cond:
            self._purge()
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                transfer = self._transfers[transfer_id] = Transfer(transfer_id, self.num_layers)
            elif transfer.state != "waiting":
                return None
            transfer.hashes, transfer.first_sent, transfer.state = list(hashes), first_sent, "open"
            self._touch(transfer)
            return transfer

    def claim(self, transfer_id: str) -> Transfer:
        """The decode request's transfer (created, waiting for the hello, if not started yet)."""
        with self.cond:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                transfer = self._transfers[transfer_id] = Transfer(transfer_id, self.num_layers)
            transfer.claimed = True
            transfer.updated = self.clock()
            return transfer

    def release(self, transfer: Transfer) -> None:
        """The decode side is done with this transfer: forget it and its bytes."""
        with self.cond:
            if self._transfers.get(transfer.transfer_id) is transfer:
                del self._transfers[transfer.transfer_id]
                self._nbytes -= transfer.nbytes
                transfer.layers = [{} for _ in range(transfer.num_layers)]
                if transfer.state in ("waiting", "open"):
                    transfer.state, transfer.error = "failed", "released"
            self.cond.notify_all()

    def add_layer(self, transfer: Transfer, layer: int, first: int, blocks: list[memoryview]) -> bool:
        """Record layer ``layer`` of blocks from ``first``; False (and the transfer failed) when the
        buffer budget is spent or the transfer is no longer open."""
        size = sum(b.nbytes for b in blocks)
        with self.cond:
            if transfer.state != "open":
                return False
            if self._nbytes + size > self.buffer_bytes:
                self._fail(transfer, "the transfer buffer is full")
                return False
            got = transfer.layers[layer]
            for i, block in enumerate(blocks):
                got[first + i] = block
            transfer.nbytes += size
            self._nbytes += size
            self._touch(transfer)
            return True

    def end(self, transfer: Transfer) -> None:
        """The prefill sent every block it meant to."""
        with self.cond:
            if transfer.state == "open":
                transfer.state = "ended"
            self._touch(transfer)

    def fail(self, transfer: Transfer, reason: str) -> None:
        """The transfer broke: nothing more arrives and nothing is handed out."""
        with self.cond:
            self._fail(transfer, reason)

    def wait_layer(self, transfer: Transfer, layer: int, first: int, count: int, timeout_s: float,
                   cancelled: Callable[[], bool]) -> bool:
        """Block until layer ``layer`` of blocks [first, first + count) landed (True), or the
        transfer ended without them, failed, was cancelled, or stayed silent ``timeout_s`` (False)."""
        with self.cond:
            while True:
                if transfer.has_layer(layer, first, count):     # every block passed its checks
                    return True
                if transfer.state in ("ended", "failed") or cancelled():
                    return False
                if self.clock() - transfer.updated > timeout_s:
                    self._fail(transfer, f"no data for {timeout_s:g} s")
                    return False
                self.cond.wait(min(0.05, timeout_s))

    @property
    def nbytes(self) -> int:
        """Bytes buffered for transfers now."""
        return self._nbytes

    def _touch(self, transfer: Transfer) -> None:
        transfer.updated = self.clock()
        self.cond.notify_all()

    def _fail(self, transfer: Transfer, reason: str) -> None:
        if transfer.state in ("waiting", "open", "ended"):
            transfer.state, transfer.error = "failed", reason
        self._touch(transfer)

    def _purge(self) -> None:
        """Drop transfers nobody claimed within the time limit (their decode request never came)."""
        now = self.clock()
        stale = [t for t in self._transfers.values()
                 if not t.claimed and now - t.updated > self.unclaimed_ttl_s]
        for transfer in stale:
            del self._transfers[transfer.transfer_id]
            self._nbytes -= transfer.nbytes
            transfer.state = "failed"
