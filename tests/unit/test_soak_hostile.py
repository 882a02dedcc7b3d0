"""The soak drill's raw-socket attacks tell a server that cuts a head off from one that takes it all."""

from __future__ import annotations

import asyncio
import random
import time

import soak_hostile
from soak_clients import Run


async def serve(handler) -> tuple[asyncio.base_events.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def takes_any_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads a head of any size, then answers 200."""
    data = b""
    while b"\r\n\r\n" not in data[-8192:]:
        chunk = await reader.read(1 << 16)
        if not chunk:
            return
        data += chunk
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    writer.close()


async def cuts_at_16k(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers 431 and closes once a head passes 16 KiB."""
    size = 0
    while size < 16384:
        chunk = await reader.read(4096)
        if not chunk:
            return
        size += len(chunk)
    writer.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


async def closes_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read(1)
    writer.close()


async def attack(handler, what: str) -> list[str]:
    server, url = await serve(handler)
    run = Run(time.monotonic(), 60, 60, {})
    hostile = soak_hostile.Hostile(run, {"r": url}, "key", body_bytes=1000, limit_bytes=1 << 16, slow_header_s=2,
                                   spam_burst=1, spam_ttl_s=60, rng=random.Random(0))
    async with server:
        if what == "slow":
            await hostile.slow_head("r")
        else:
            await hostile.raw_head("r", "many_headers", lambda i: f"X-Pad-{i}: ".encode() + b"a" * 1000 + b"\r\n")
    return sorted({r.status for r in run.records})


def test_a_head_the_server_takes_whole_is_unlimited() -> None:
    assert asyncio.run(attack(takes_any_head, "endless")) == ["unlimited:200"]


def test_a_head_cut_off_is_refused() -> None:
    # The 431 may be read, or lost to the reset of the socket still being written: both are a refusal.
    assert asyncio.run(attack(cuts_at_16k, "endless")) in (["431"], ["closed"])
    assert asyncio.run(attack(closes_at_once, "endless")) == ["closed"]


def test_a_slow_head_is_held_open_unless_the_server_closes_it() -> None:
    assert asyncio.run(attack(takes_any_head, "slow")) == ["held_open"]
    assert asyncio.run(attack(closes_at_once, "slow")) == ["closed"]
