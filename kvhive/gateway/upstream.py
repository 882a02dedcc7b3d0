"""A lean HTTP/1.1 client for forwarding requests to replicas: keep-alive connections per replica,
the answer's body read as it arrives.

The gateway's hot path spent more time in a general-purpose client (httpx on h11: per-request
objects, state machines and pool scans) than in everything else it does. A replica is a known
HTTP/1.1 server, so this client does only what forwarding needs: write the request in one write,
parse the status line and headers, and read a Content-Length, chunked or read-to-close body.

Time limits: connecting takes at most ``connect_timeout_s``; with ``request_timeout_s`` (None: no
limit), the whole exchange of an answer with a known length (Content-Length) must end within it,
and a streamed answer (chunked or read to close) must bring its status, headers and first piece of
body within it, then each next piece within it of the one before.

A pooled connection that the replica closed while idle fails before any byte of the answer; that
request is sent once more on a new connection (the replica never saw it). Every other failure is
the caller's, an ``UpstreamError`` whose ``kind`` says what failed: ``UpstreamUnanswered`` when no
byte of an answer came back (``UpstreamConnectError``: the replica cannot be reached; else the
connection was closed or reset before the status line), so the request may go to another replica;
``UpstreamTimeout`` past the limits above; ``UpstreamMalformed`` for an answer that is not HTTP;
a plain ``UpstreamError`` for an answer cut part-way.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

_CHUNK = 65536


class UpstreamError(Exception):
    """The replica's answer could not be read; ``kind`` (one of ``outlier.FAILURE_KINDS``) says
    why: "cut" for an answer that stopped part-way, unless a subclass says otherwise."""

    kind = "cut"


class UpstreamTimeout(UpstreamError):
    """The replica did not answer within the request's time limit (it may still be working on it)."""

    kind = "timeout"


class UpstreamMalformed(UpstreamError):
    """The replica's answer is not what was expected: not HTTP, or a body that is not the JSON or
    server-sent events its headers announce."""

    kind = "malformed"


class UpstreamUnanswered(UpstreamError):
    """No byte of an answer came back: the connection was refused, timed out while connecting, or
    was closed or reset before the status line. ``reason`` is "connect", "connect_timeout" or
    "reset". A read that timed out waiting for the answer is not one of these (the replica may
    still be working on the request)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def kind(self) -> str:  # type: ignore[override]
        """The failure's kind: its reason."""
        return self.reason


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
                 keep_alive: bool, deadline: float | None) -> None:
        self.status_code = status
        self.headers = headers
        self._client, self._origin, self._conn = client, origin, conn
        self._framing, self._length, self._keep_alive = framing, length, keep_alive
        self._complete = framing == "none"
        self._closed = False
        self._deadline = deadline           # loop time by which the body (or its first piece) is read

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
        """The body, piece by piece as it arrives (a chunked body: one piece per chunk); a body of
        known length within the request's deadline, a streamed one's first piece within it and each
        next piece within the time limit of the one before (``UpstreamTimeout`` past them)."""
        reader, gap_s = self._conn.reader, self._client.request_timeout_s
        try:
            if self._framing == "length":
                remaining = self._length
                while remaining:
                    async with asyncio.timeout_at(self._deadline):
                        data = await reader.read(min(remaining, _CHUNK))
                    if not data:
                        raise UpstreamError("the replica closed the connection mid-body")
                    remaining -= len(data)
                    yield data
            elif self._framing == "chunked":
                first = True
                while True:
                    async with self._piece_limit(first, gap_s):
                        size = int(((await reader.readuntil(b"\r\n")).split(b";", 1)[0]).strip(), 16)
                        if size == 0:
                            while await reader.readuntil(b"\r\n") != b"\r\n":   # trailers
                                pass
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
                    first = False
            elif self._framing == "close":
                first = True
                while True:
                    async with self._piece_limit(first, gap_s):
                        data = await reader.read(_CHUNK)
                    if not data:
                        break
                    yield data
                    first = False
        except TimeoutError as exc:
            raise UpstreamTimeout(f"the replica's answer did not come within {gap_s} s") from exc
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise UpstreamError(f"reading the replica's answer failed: {type(exc).__name__}: {exc}") \
                from exc
        self._complete = True

    def _piece_limit(self, first: bool, gap_s: float | None) -> asyncio.Timeout:
        """The time limit on reading a streamed body's next piece: the request's deadline for the
        first, ``gap_s`` after the one before for the others."""
        return asyncio.timeout_at(self._deadline) if first else asyncio.timeout(gap_s)

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

    def __init__(self, connect_timeout_s: float = 5.0, request_timeout_s: float | None = 600.0,
                 max_idle_per_replica: int = 64) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
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
        limit_s = self.request_timeout_s
        deadline = None if limit_s is None else asyncio.get_running_loop().time() + limit_s
        while True:
            conn = self._idle_connection(origin)
            if conn is None:
                conn = await self._connect(origin, deadline)
            try:
                async with asyncio.timeout_at(deadline):
                    conn.writer.write(payload)
                    await conn.writer.drain()
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
            except TimeoutError as exc:
                # TimeoutError is an OSError: a slow answer is not a refused one.
                conn.close()
                raise UpstreamTimeout(f"no answer from the replica within {limit_s} s") from exc
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                conn.close()
                message = f"no answer from the replica: {type(exc).__name__}: {exc}"
                partial = exc.partial if isinstance(exc, asyncio.IncompleteReadError) else b""
                if isinstance(exc, asyncio.LimitOverrunError) or (partial and not partial.startswith(b"HTTP/")):
                    raise UpstreamMalformed(f"the replica's answer is not HTTP: {partial[:80]!r}") from exc
                if partial:
                    raise UpstreamError(message) from exc       # a status line began, then stopped
                if conn.reused:
                    continue            # closed by the replica while idle: it never saw the request
                raise UpstreamUnanswered(message, "reset") from exc
            try:
                return self._response(origin, conn, raw, method, deadline)
            except ValueError as exc:
                conn.close()
                raise UpstreamMalformed(f"malformed answer from the replica: {exc}") from exc

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _response(self, origin: tuple[str, int, bool], conn: _Connection, raw: bytes,
                  method: str, deadline: float | None) -> UpstreamResponse:
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
        return UpstreamResponse(self, origin, conn, status, headers, framing, length, keep_alive, deadline)

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

    async def _connect(self, origin: tuple[str, int, bool], deadline: float | None) -> _Connection:
        host, port, secure = origin
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        connect_by = asyncio.get_running_loop().time() + self.connect_timeout_s
        try:
            async with asyncio.timeout_at(connect_by if deadline is None else min(connect_by, deadline)):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self._ssl if secure else None, limit=2**20)
        except (OSError, TimeoutError) as exc:
            reason = "connect_timeout" if isinstance(exc, TimeoutError) else "connect"
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {type(exc).__name__}: {exc}",
                                       reason) from exc
        return _Connection(reader, writer)
