"""Prompt-cache pins over a real redis-server shared by two replicas' session services: a pin
written on one is read on the other, and a pin held in memory only never depends on Redis."""

from __future__ import annotations

import asyncio
import hashlib

from support.redis_server import RedisServer
from support.servers import wait_until
from support.sessions import BLOCK_BYTES, BLOCK_SIZE, CONFIG, Holder

from kvhive.sessions.backends import RedisBackend
from kvhive.sessions.prefix_pins import Breakpoint, CacheUsage
from kvhive.sessions.service import SessionService
from kvhive.store.redis_keys import RedisKeys

PREFIX = RedisKeys("m").sessions
PROMPT = list(range(500, 500 + 4 * BLOCK_SIZE + 3))
HASHES = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(4)]


def replica(redis_server: RedisServer, holder: Holder) -> SessionService:
    return SessionService(CONFIG, holder, block_bytes=BLOCK_BYTES, block_size=BLOCK_SIZE,
                          backend=RedisBackend(redis_server.url, PREFIX))


def request(sessions: SessionService, breakpoints: list[Breakpoint], cached_tokens: int) -> CacheUsage:
    turn = asyncio.run(sessions.prefix_pins.open("k", "m", PROMPT, breakpoints))
    return turn.end(HASHES, cached_tokens)


def test_a_pin_written_on_one_replica_is_read_on_another(redis_server: RedisServer) -> None:
    one, two_holder = replica(redis_server, Holder()), Holder()
    two = replica(redis_server, two_holder)
    points = [Breakpoint(4 * BLOCK_SIZE, 600)]
    assert request(one, points, 0).cache_creation_input_tokens == 4 * BLOCK_SIZE
    backend = RedisBackend(redis_server.url, PREFIX)
    [pin] = one.list("k")
    wait_until(lambda: backend.load("k", pin.session_id) is not None, 5.0, "the pin's record in Redis")
    assert request(two, points, 4 * BLOCK_SIZE) == CacheUsage(4 * BLOCK_SIZE, 0, 3)
    assert two_holder.held == [(pin.engine_id, HASHES)]         # loaded from Redis and pinned there


def test_an_in_memory_pin_is_never_written_nor_ended_by_redis(redis_server: RedisServer) -> None:
    one = replica(redis_server, Holder())
    points = [Breakpoint(4 * BLOCK_SIZE, 300, in_memory=True)]
    request(one, points, 0)
    [pin] = one.list("k")
    assert request(one, points, 4 * BLOCK_SIZE).cache_read_input_tokens == 4 * BLOCK_SIZE
    assert one.list("k") == [pin] and RedisBackend(redis_server.url, PREFIX).load("k", pin.session_id) is None
    assert request(replica(redis_server, Holder()), points, 4 * BLOCK_SIZE).cache_read_input_tokens == 0
