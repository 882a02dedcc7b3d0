"""Tiny asyncio HTTP servers in process (real sockets) that answer as a test scripts them, and a
``Gateway`` forwarding to them: the harness of the gateway's forwarding tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from support.servers import free_port

from kvhive.gateway.gateway import Gateway
from kvhive.gateway.gateway_config import ReplicaSpec
from kvhive.gateway.metrics import GatewayMetrics
from kvhive.gateway.replicas import Replica, ReplicaSet
from kvhive.gateway.upstream import UpstreamClient
from kvhive.routing.affinity import SessionAffinity
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.scorer import RoutingWeights

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok": "y"}'
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)


def answers(*parts: bytes, close: bool = True, delay_s: float = 0.0) -> Handler:
    """Reads each request, writes ``parts`` (pausing ``delay_s`` between them), then closes the
    connection (or keeps it for the next request)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(delay_s)
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.transport.abort()
    return handle


async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads the request and never answers."""
    await read_request(reader)
    await asyncio.sleep(30)


def served(*handlers: Handler | None) -> Callable[[Callable[..., Awaitable[Any]]], Any]:
    """Runs ``test(urls)`` with one server per handler (None: a port nobody listens on)."""
    def run(test: Callable[..., Awaitable[Any]]) -> Any:
        async def main() -> Any:
            servers, urls = [], []
            for handler in handlers:
                port = free_port()
                if handler is not None:
                    servers.append(await asyncio.start_server(handler, "127.0.0.1", port))
                urls.append(f"http://127.0.0.1:{port}")
            try:
                return await test(urls)
            finally:
                for server in servers:
                    server.close()
        return asyncio.run(main())
    return run


def gateway_for(urls: list[str], request_timeout_s: float = 5.0) -> Gateway:
    replicas = [Replica(ReplicaSpec(u), healthy=True) for u in urls]
    return Gateway(ReplicaSet(replicas, InMemoryIndex(), client=None), indexer=None,
                   sessions=SessionAffinity(), weights=RoutingWeights(), metrics=GatewayMetrics(),
                   client=None, policy="round_robin",
                   upstream=UpstreamClient(connect_timeout_s=1.0, request_timeout_s=request_timeout_s))


def scope_for(path: str = "/v1/completions", authorization: str = "Bearer key-a") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "query_string": b"",
            "headers": [(b"content-type", b"application/json"),
                        (b"authorization", authorization.encode())]}


async def forward(gateway: Gateway, path: str = "/v1/completions", session_id: str | None = None,
                  owner: str = "owner-a") -> tuple[int, dict[str, str], bytes]:
    """Forward one POST to the gateway's replicas in order: the status, headers and body the client
    gets (UpstreamError when the answer is cut for the client too)."""
    scope = scope_for(path)
    request = Request(scope)
    response = await gateway.forward(request, b"{}", gateway.replicas.replicas, "load", owner,
                                     session_id=session_id)
    messages: list[dict[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await response(scope, receive, send)
    start = messages[0]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in messages[1:])
    assert messages[-1].get("more_body", False) is False
    return start["status"], headers, body


def sample(gateway: Gateway, name: str, labels: dict[str, str] | None = None) -> float:
    return gateway.metrics.registry.get_sample_value(name, labels or {}) or 0.0
