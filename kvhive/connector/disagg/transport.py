"""The direct prefill-to-decode channel over TCP (the transport interface; RDMA would be another).

One connection per transfer, prefill -> decode:

    prefill: hello {transfer_id, key_prefix, num_layers, hashes}
    decode:  ready {skip}  (leading blocks it already holds: not sent)  |  refused {reason}
    prefill: layer {layer, first_block, count} + records ... (one frame per layer per step)
    prefill: end {num_blocks}

The decode side checks the key prefix (model fingerprint, layout, dtype, block size) at the hello
and every block's record against its own key, so another model's KV is refused or detected.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Protocol

from kvhive.connector.disagg.incoming import Transfer, TransferTable
from kvhive.connector.disagg.wire import (
    MAX_BLOCKS,
    WireError,
    blocking_with_deadline,
    decode_layer,
    encode_layer,
    recv_frame,
    send_frame,
)
from kvhive.store.key import KeySpace, StoreKey

logger = logging.getLogger(__name__)


class TransferRefused(ConnectionError):
    """The decode instance refused the transfer (another model, a busy id, a full buffer)."""


class KVSendChannel(Protocol):
    """The prefill side of one transfer; every call may raise ConnectionError."""

    def open(self, transfer_id: str, hashes: list[bytes]) -> int:
        """Announce the transfer's prompt blocks; the number of leading ones the decode side holds."""
        ...

    def send_layer(self, layer: int, first_block: int, keys: list[StoreKey], blocks: list[memoryview]) -> None:
        """Send layer ``layer`` of consecutive blocks from ``first_block``."""
        ...

    def end(self, num_blocks: int) -> None:
        """Every block is sent; the channel closes."""
        ...

    def close(self) -> None:
        """Drop the channel (a transfer not ended fails on the decode side)."""
        ...


class TcpSendChannel:
    """KVSendChannel over one TCP connection."""

    def __init__(self, endpoint: tuple[str, int], key_space: KeySpace, num_layers: int, timeout_s: float) -> None:
        self.endpoint, self.key_space, self.num_layers, self.timeout_s = endpoint, key_space, num_layers, timeout_s
        self._sock: socket.socket | None = None

    def open(self, transfer_id: str, hashes: list[bytes]) -> int:
        """Connect, say hello, and read how many leading blocks to skip."""
        self._sock = socket.create_connection(self.endpoint, timeout=self.timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(self._sock, {"type": "hello", "transfer_id": transfer_id, "key_prefix": self.key_space.prefix,
                                "num_layers": self.num_layers, "hashes": hashes[:MAX_BLOCKS]})
        reply, _ = recv_frame(self._sock)
        if reply.get("type") != "ready" or not isinstance(reply.get("skip"), int):
            raise TransferRefused(str(reply.get("reason", "refused")))
        return reply["skip"]

    def send_layer(self, layer: int, first_block: int, keys: list[StoreKey], blocks: list[memoryview]) -> None:
        """One ``layer`` frame."""
        send_frame(self._sock, {"type": "layer", "layer": layer, "first_block": first_block,
                                "count": len(blocks)}, encode_layer(keys, blocks))

    def end(self, num_blocks: int) -> None:
        """The ``end`` frame, then close."""
        send_frame(self._sock, {"type": "end", "num_blocks": num_blocks})
        self.close()

    def close(self) -> None:
        """Close the connection."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class TcpReceiver:
    """The decode side's transfer endpoint: one thread per incoming transfer fills the table."""

    def __init__(self, host: str, port: int, key_space: KeySpace, table: TransferTable, timeout_s: float,
                 held_blocks: Callable[[list[bytes]], int]) -> None:
        """``held_blocks(hashes)``: how many leading blocks this instance holds (any thread)."""
        self.key_space, self.table, self.timeout_s, self.held_blocks = key_space, table, timeout_s, held_blocks
        self._server = socket.create_server((host, port), reuse_port=False)
        self.port = self._server.getsockname()[1]
        self.received_bytes = self.received_blocks = self.failed_transfers = 0
        self._closed = False
        self._accepter = threading.Thread(target=self._accept_loop, name="kvhive-kv-recv", daemon=True)
        self._accepter.start()

    def close(self) -> None:
        """Stop accepting (transfers in flight fail as their streams close)."""
        self._closed = True
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="kvhive-kv-recv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Receive one transfer; any error fails it (the decode side then recomputes)."""
        transfer = None
        with conn:
            blocking_with_deadline(conn, self.timeout_s)
            try:
                transfer = self._hello(conn)
                if transfer is not None:
                    self._receive(conn, transfer)
            except (OSError, WireError, ValueError, KeyError, TypeError) as exc:
                if transfer is not None:
                    self.failed_transfers += 1
                    self.table.fail(transfer, f"{type(exc).__name__}: {exc}")
                    logger.warning("KV transfer %s failed: %s", transfer.transfer_id, exc)

    def _hello(self, conn: socket.socket) -> Transfer | None:
        """Check the hello; answer ready (with the blocks to skip) or refused."""
        hello, _ = recv_frame(conn)
        reason = None
        hashes = hello.get("hashes")
        if hello.get("type") != "hello" or not isinstance(hashes, list) or not isinstance(hello.get("transfer_id"), str):
            reason = "expected a hello"
        elif hello.get("key_prefix") != self.key_space.prefix or hello.get("num_layers") != self.table.num_layers:
            reason = "the KV is another model's (fingerprint, layout, dtype, block size or layers differ)"
        elif not all(isinstance(h, bytes) and len(h) == 16 for h in hashes):
            reason = "malformed block hashes"
        transfer = None if reason else self.table.open(hello["transfer_id"], hashes, self.held_blocks(hashes))
        if transfer is None:
            send_frame(conn, {"type": "refused", "reason": reason or "that transfer id is already receiving"})
            return None
        send_frame(conn, {"type": "ready", "skip": transfer.first_sent})
        return transfer

    def _receive(self, conn: socket.socket, transfer: Transfer) -> None:
        """Layer frames until ``end``; WireError on anything out of place."""
        while True:
            frame, body = recv_frame(conn)
            if frame.get("type") == "end":
                self.table.end(transfer)
                return
            layer, first, count = frame.get("layer"), frame.get("first_block"), frame.get("count")
            if frame.get("type") != "layer" or not isinstance(layer, int) or not 0 <= layer < transfer.num_layers \
                    or not isinstance(first, int) or not isinstance(count, int) \
                    or not transfer.first_sent <= first <= first + count <= len(transfer.hashes):
                raise WireError(f"unexpected frame {frame.get('type')!r}")
            keys = self.key_space.keys(transfer.hashes[first:first + count])
            blocks = decode_layer(body, keys)
            if not self.table.add_layer(transfer, layer, first, blocks):
                raise WireError(transfer.error or "the transfer is closed")
            self.received_bytes += len(body)
            self.received_blocks += count if layer == transfer.num_layers - 1 else 0
