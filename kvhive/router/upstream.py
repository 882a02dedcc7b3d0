"""A lean HTTP/1.1 client for forwarding requests to replicas: keep-alive connections per replica,
the answer's body read as it arrives.

The gateway's hot path spent more time in a general-purpose client (httpx on h11: per-request
objects, state machines and pool scans) than in everything else it does. A replica is a known
HTTP/1.1 server, so this client does only what forwarding needs: write the request in one write,
parse the status line and headers, and read a Content-Length, chunked or read-to-close body.

A pooled connection that the replica closed while idle fails before any byte of the answer; that
request is sent once more on a new connection (the replica never saw it). Every other failure is
the caller's: ``UpstreamUnanswered`` when no byte of an answer came back (``UpstreamConnectError``:
the replica cannot be reached; else the connection was closed or reset before the status line),
so the request may go to another replica; ``UpstreamError`` otherwise.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

_CHUNK = 65536


class UpstreamError(Exception):
    """The replica's answer could not be read (cut, malformed or too slow)."""


class UpstreamUnanswered(UpstreamError):
    """No byte of an answer came back: the connection was refused, timed out while connecting, or
    was closed or reset before the status line. ``reason`` is "connect", "connect_timeout" or
    "reset". A read that timed out waiting for the answer is not one of these (the replica may
    still be working on the request)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class UpstreamConnectError(UpstreamUnanswered):
    """No connection to the replica could be made (it is down or refuses connections)."""


class _Connection:
    """One keep-alive connection to a replica."""

    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        """Close the socket without waiting (aborting any read in progress)."""
        self.writer.transport.abort()


class UpstreamResponse:
    """A replica's answer: status and headers read, body left to ``chunks()`` or ``read()``.

    ``close()`` must be called once: it returns a fully read connection to the pool and closes any
    other (so a replica stops generating for a client that left)."""

    def __init__(self, client: UpstreamClient, origin: tuple[str, int, bool], conn: _Connection,
                 status: int, headers: list[tuple[bytes, bytes]], framing: str, length: int,
                 keep_alive: bool) -> None:
        self.status_code = status
        self.headers = headers
        self._client, self._origin, self._conn = client, origin, conn
        self._framing, self._length, self._keep_alive = framing, length, keep_alive
        self._complete = framing == "none"
        self._closed = False

    @property
    def streamed(self) -> bool:
        """Whether the body's length was unknown when the answer began (chunked or read to close):
        the replica may still be generating it."""
        return self._framing in ("chunked", "close")

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives (a chunked body: one piece per chunk)."""
        reader, timeout = self._conn.reader, self._client.read_timeout_s
        try:
            if self._framing == "length":
                remaining = self._length
                while remaining:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(min(remaining, _CHUNK))
                    if not data:
                        raise UpstreamError("the replica closed the connection mid-body")
                    remaining -= len(data)
                    yield data
            elif self._framing == "chunked":
                while True:
                    async with asyncio.timeout(timeout):
                        size = int(((await reader.readuntil(b"\r\n")).split(b";", 1)[0]).strip(), 16)
                        if size == 0:
                            while await reader.readuntil(b"\r\n") != b"\r\n":   # trailers
                                pass
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._framing == "close":
                while True:
                    async with asyncio.timeout(timeout):
                        data = await reader.read(_CHUNK)
                    if not data:
                        break
                    yield data
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                TimeoutError) as exc:
            raise UpstreamError(f"reading the replica's answer failed: {type(exc).__name__}: {exc}") \
                from exc
        self._complete = True

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Give the connection back for reuse when the body was read to its end, else close it."""
        if self._closed:
            return
        self._closed = True
        if self._complete and self._keep_alive:
            self._client._release(self._origin, self._conn)
        else:
            self._conn.close()


class UpstreamClient:
    """HTTP/1.1 requests to replicas over pooled keep-alive connections (one event loop)."""

    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0,
                 max_idle_per_replica: int = 64) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle_per_replica = max_idle_per_replica
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def send(self, method: str, url: str, headers: Iterable[tuple[bytes, bytes]],
                   body: bytes = b"") -> UpstreamResponse:
        """Send one request; the answer's status and headers are read, its body is not.

        ``headers`` are sent as given, after Host and before Content-Length (give neither)."""
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        origin = (parts.hostname or "localhost", parts.port or (443 if secure else 80), secure)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = bytearray(f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\n".encode("latin-1"))
        for key, value in headers:
            head += key + b": " + value + b"\r\n"
        if body or method in ("POST", "PUT", "PATCH"):
            head += b"content-length: %d\r\n" % len(body)
        head += b"\r\n"
        payload = bytes(head) + body
        while True:
            conn = self._idle_connection(origin)
            if conn is None:
                conn = await self._connect(origin)
            try:
                conn.writer.write(payload)
                await conn.writer.drain()
                async with asyncio.timeout(self.read_timeout_s):
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
                conn.close()
                message = f"no answer from the replica: {type(exc).__name__}: {exc}"
                # TimeoutError is an OSError: a slow answer is not a refused one.
                nothing_read = not isinstance(exc, TimeoutError) and (
                    isinstance(exc, OSError) or (isinstance(exc, asyncio.IncompleteReadError)
                                                 and not exc.partial))
                if not nothing_read:
                    raise UpstreamError(message) from exc
                if conn.reused:
                    continue            # closed by the replica while idle: it never saw the request
                raise UpstreamUnanswered(message, "reset") from exc
            try:
                return self._response(origin, conn, raw, method)
            except ValueError as exc:
                conn.close()
                raise UpstreamError(f"malformed answer from the replica: {exc}") from exc

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _response(self, origin: tuple[str, int, bool], conn: _Connection, raw: bytes,
                  method: str) -> UpstreamResponse:
        lines = raw[:-4].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"status line {lines[0][:80]!r}")
        status = int(rest[:3])
        headers = []
        length, chunked, keep_alive = -1, False, version == b"HTTP/1.1"
        for line in lines[1:]:
            key, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"header line {line[:80]!r}")
            key, value = key.strip(), value.strip()
            headers.append((key, value))
            name = key.lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif name == b"connection":
                keep_alive = b"close" not in value.lower() and (keep_alive or b"keep-alive" in value.lower())
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            framing = "none"
        elif chunked:
            framing = "chunked"
        elif length >= 0:
            framing = "length" if length else "none"
        else:
            framing, keep_alive = "close", False
        return UpstreamResponse(self, origin, conn, status, headers, framing, length, keep_alive)

    def _idle_connection(self, origin: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()
            if conn.reader.at_eof() or conn.writer.transport.is_closing():
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def _release(self, origin: tuple[str, int, bool], conn: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) < self.max_idle_per_replica and not conn.writer.transport.is_closing():
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, origin: tuple[str, int, bool]) -> _Connection:
        host, port, secure = origin
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._ssl if secure else None, limit=2**20)
        except (OSError, TimeoutError) as exc:
            reason = "connect_timeout" if isinstance(exc, TimeoutError) else "connect"
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}",
                                       reason) from exc
        return _Connection(reader, writer)
