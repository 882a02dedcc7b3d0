"""uvicorn's HTTP/1.1 protocol (h11) with ``HttpLimits`` enforced on every connection.

uvicorn's own h11 protocol bounds an unfinished request head but answers it 400, and bounds
neither the header fields, nor the time to send a head, nor the open connections (its
``limit_concurrency`` is checked only once a request has arrived). ``LimitedH11Protocol`` answers:

- 431 to a head over ``max_header_bytes`` (an unfinished one once more than that is buffered, at
  most one socket read beyond it) or with more than ``max_headers`` fields;
- 408 to a head not complete ``header_timeout_s`` after its connection opened, or on a kept-alive
  connection after the first byte of the next request; once the head is in, nothing is timed, so
  a response may stream as long as it runs;
- 503 to a connection opened while ``max_connections`` are open, before it sends anything.

An idle kept-alive connection is closed ``keep_alive_timeout_s`` after its last response
(uvicorn's own timer). Each refusal is a plain-text response with ``Connection: close``, then a
lingering close: the server shuts its sending side, discards what the client still sends, and
closes when the client does or after LINGER_S, so the client reads the status instead of a reset.
A response the application sent before reading the whole request body (a 413 for a declared
length over the limit) is closed the same lingering way: a proxy still sending that body, the
gateway among them, then reads the answer and passes it on instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import functools
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from kvhive.core.http_limits import HttpLimits

LINGER_S = 2.0          # how long a refused connection is drained before it is closed regardless


def head_bytes(request: h11.Request) -> int:
    """The bytes of ``request``'s head as parsed: request line, fields, separators, blank line."""
    request_line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return request_line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class HeadLimitedConnection(h11.Connection):
    """h11's server side of one connection that refuses a head over the size or field-count limit.

    ``next_event`` raises ``h11.RemoteProtocolError`` for every malformed request, as h11 does;
    ``refusal`` then holds the status and message to answer it with (431 for a head too large).
    """

    def __init__(self, limits: HttpLimits) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.limits = limits
        self.refusal = (400, "Invalid HTTP request received.")

    def next_event(self) -> Any:
        """h11's next event; a ``Request`` whose head passes a limit raises instead."""
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = (exc.error_status_hint, "Invalid HTTP request received.")
            if exc.error_status_hint == 431:            # h11's one 431: its buffer passed the limit
                self.refusal = (431, self._too_large())
            raise
        if isinstance(event, h11.Request):
            if len(event.headers) > self.limits.max_headers:
                self.refusal = (431, f"The request has more than {self.limits.max_headers} header fields.")
                raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=431)
            if head_bytes(event) > self.limits.max_header_bytes:
                self.refusal = (431, self._too_large())
                raise h11.RemoteProtocolError(self.refusal[1], error_status_hint=431)
        return event

    def _too_large(self) -> str:
        return f"The request line and header fields exceed {self.limits.max_header_bytes} bytes."


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under ``limits``: the head's size, fields and time, and the number of
    open connections (see the module docstring)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: HttpLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = HeadLimitedConnection(limits)
        self.head_timer: asyncio.TimerHandle | None = None      # set while a head is awaited
        self.linger_timer: asyncio.TimerHandle | None = None    # set once the connection is refused
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection; refuse it (503) over the cap, else start timing its first head."""
        super().connection_made(transport)
        self.raw_transport = transport
        self.transport = LingeringTransport(transport, self)  # type: ignore[assignment]
        open_connections = len(self.connections)
        if open_connections > self.limits.max_connections:
            if open_connections == self.limits.max_connections + 1:     # once each time the cap is reached
                self.logger.warning("%d connections open (--http-max-connections): new ones get 503",
                                    self.limits.max_connections)
            self.refuse(503, f"The server has {self.limits.max_connections} connections open, its limit.")
            return
        self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        """Feed ``data`` to h11 (or drop it once refused); time a next head from its first byte."""
        if self.refused:
            return
        if self.conn.their_state is h11.IDLE and self.head_timer is None:
            self._start_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:       # the head is in (or the connection failed)
            self._stop_head_timer()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to every h11 protocol error: here the status the error calls for."""
        status, message = self.conn.refusal
        self.refuse(status, message)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop this connection's timers, then uvicorn's own bookkeeping."""
        self._stop_head_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """Close a refused connection at once; others as uvicorn does (after their response)."""
        if self.refused:
            self.raw_transport.close()
            return
        super().shutdown()

    def close_transport(self) -> None:
        """Close the connection; while the client is still sending a request body, lingering."""
        transport = self.raw_transport
        if self.linger_timer is not None or transport.is_closing():
            return                              # lingering already, or closed
        if self.conn.their_state is h11.SEND_BODY and transport.can_write_eof():
            self.refused = True                 # what the client still sends is dropped
            transport.write_eof()
            self.linger_timer = self.loop.call_later(LINGER_S, transport.close)
            return
        transport.close()

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with ``message`` and ``Connection: close``, then close lingering."""
        self._stop_head_timer()
        self._unset_keepalive_if_required()
        self.refused = True
        body = message.encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                f"content-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n").encode()
        self.raw_transport.write(head + body)
        if not self.raw_transport.can_write_eof():
            self.raw_transport.close()
            return
        self.raw_transport.write_eof()         # the client reads the answer, then its EOF
        self.linger_timer = self.loop.call_later(LINGER_S, self.raw_transport.close)

    def _start_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.refuse(408, f"The request head did not arrive within {self.limits.header_timeout_s:g} s.")


class LingeringTransport:
    """A connection's transport whose ``close`` lingers while the client is still sending a body
    (``LimitedH11Protocol.close_transport``); every other call goes to the transport as it is."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        """Close, lingering where the client has not sent its whole request."""
        self._protocol.close_transport()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that serve HTTP/1.1 with h11 under ``limits``, whatever
    else (httptools, websockets) is installed."""
    return {"http": functools.partial(LimitedH11Protocol, limits=limits), "ws": "none",
            "timeout_keep_alive": limits.keep_alive_timeout_s, "limit_concurrency": None}
