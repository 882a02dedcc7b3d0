"""HTTP/1.1 over a raw socket, for tests of what a server does before a request reaches its app:
send part of a head, stall, flood, and read back the status and whether the server closed."""

from __future__ import annotations

import select
import socket
from dataclasses import dataclass

HEALTH_REQUEST = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"
READ_TIMEOUT_S = 60.0       # a server that neither answers nor closes within this fails the test


@dataclass(frozen=True)
class RawResponse:
    """A response read off a raw socket: status, lower-cased headers, body."""

    status: int
    headers: dict[str, str]
    body: bytes


def connect(url: str) -> socket.socket:
    """A TCP connection to ``http://host:port`` with a read timeout of READ_TIMEOUT_S."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=READ_TIMEOUT_S)
    sock.settimeout(READ_TIMEOUT_S)
    return sock


def read_response(sock: socket.socket) -> RawResponse:
    """One response with a ``Content-Length`` body (AssertionError if the connection ends first)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return RawResponse(int(status_line.split()[1]), headers, body[:length])


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes ``sock`` with nothing more to read (waits up to READ_TIMEOUT_S)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def flood_until_answered(sock: socket.socket, prefix: bytes, filler: bytes, most_bytes: int) -> int:
    """Send ``prefix``, then ``filler`` again and again until the server has something to say (or
    closes), or ``most_bytes`` are sent; returns the bytes the kernel accepted from us."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)     # little queued on our side
    sock.sendall(prefix)
    sent = len(prefix)
    while sent < most_bytes:
        readable, writable, _ = select.select([sock], [sock], [], READ_TIMEOUT_S)
        if readable or not writable:            # an answer, or a server that stopped reading
            break
        try:
            sent += sock.send(filler)
        except (BrokenPipeError, ConnectionResetError):
            break
    return sent
