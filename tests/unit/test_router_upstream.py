"""The gateway's HTTP/1.1 upstream client against a tiny asyncio server: framing, keep-alive,
a connection the server closed while idle, and a replica that is down."""

from __future__ import annotations

import asyncio

import pytest
from support.servers import free_port

from kvhive.gateway.upstream import UpstreamClient, UpstreamConnectError, UpstreamError


class TinyServer:
    """Answers each request with the next canned response; counts connections and requests."""

    def __init__(self, answers: list[bytes], close_after_each: bool = False) -> None:
        self.answers = answers
        self.close_after_each = close_after_each
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                writer.write(answer)
                await writer.drain()
                if self.close_after_each or b"connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def run(coro_fn, server: TinyServer):
    async def main():
        port = free_port()
        srv = await asyncio.start_server(server.handle, "127.0.0.1", port)
        client = UpstreamClient(request_timeout_s=5)
        try:
            return await coro_fn(client, f"http://127.0.0.1:{port}")
        finally:
            client.close()
            srv.close()
            for w in server.writers:
                w.close()
    return asyncio.run(main())


def test_framings_and_keep_alive() -> None:
    server = TinyServer([
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"a\":1}",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"6\r\ndata: \r\n3;ext=1\r\nabc\r\n0\r\nx-trailer: 1\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n{\"detail\": \"no\"}"])

    async def go(client: UpstreamClient, base: str):
        first = await client.send("POST", base + "/v1/completions?x=1", [(b"x-session-id", b"s1")], b"{}")
        assert first.status_code == 200 and first.header(b"content-type") == b"application/json"
        assert await first.read() == b'{"a":1}'
        first.close()
        second = await client.send("POST", base + "/v1/completions", [], b"{}")
        assert [c async for c in second.chunks()] == [b"data: ", b"abc"]     # chunk by chunk
        second.close()
        third = await client.send("DELETE", base + "/v1/context/s1", [])
        assert third.status_code == 204 and await third.read() == b""
        third.close()
        fourth = await client.send("GET", base + "/x", [])
        assert fourth.status_code == 400 and await fourth.read() == b'{"detail": "no"}'
        fourth.close()

    run(go, server)
    assert server.connections == 1                  # one keep-alive connection for the first three
    assert server.requests[0].startswith(b"POST /v1/completions?x=1 HTTP/1.1\r\n")
    assert b"x-session-id: s1\r\n" in server.requests[0] and server.requests[0].endswith(b"\r\n\r\n{}")


def test_a_connection_closed_while_idle_is_replaced_and_the_request_sent_once() -> None:
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = TinyServer([ok, ok], close_after_each=True)   # answers, then closes: the pool does not know

    async def go(client: UpstreamClient, base: str):
        for _ in range(2):
            response = await client.send("POST", base + "/v1/completions", [], b"{}")
            assert await response.read() == b"ok"
            response.close()
            await asyncio.sleep(0.05)

    run(go, server)
    assert server.connections == 2 and len(server.requests) == 2


def test_a_cut_body_and_a_down_replica_raise() -> None:
    server = TinyServer([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"], close_after_each=True)

    async def go(client: UpstreamClient, base: str):
        response = await client.send("POST", base + "/v1/completions", [], b"{}")
        with pytest.raises(UpstreamError):
            await response.read()
        response.close()
        with pytest.raises(UpstreamConnectError):
            await client.send("POST", f"http://127.0.0.1:{free_port()}/v1/completions", [], b"{}")

    run(go, server)
