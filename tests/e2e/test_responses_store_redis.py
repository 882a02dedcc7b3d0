"""Stored responses in a real redis-server: the Redis backend persists like the file one, is shared
by replicas, and keeps a conversation through a loss of Redis's data."""

from __future__ import annotations

import pytest
from support.redis_server import RedisServer
from support.responses import Clock, assert_backend_persists, chain, stored

from kvhive.sessions.registry import SessionError
from kvhive.sessions.response_backends import RedisResponseBackend
from kvhive.sessions.response_store import (
    ResponseStore,
    conversation_of,
)
from kvhive.store.redis_keys import RedisKeys

PREFIX = RedisKeys("m").responses          # the stored-response keys of a replica serving model "m"


def test_the_redis_backend_persists_adds_deletes_and_expiry(redis_server: RedisServer) -> None:
    assert_backend_persists(RedisResponseBackend(redis_server.url, PREFIX))


def test_a_shared_backend_sees_other_replicas_turns(redis_server: RedisServer) -> None:
    clock = Clock()
    one = ResponseStore(RedisResponseBackend(redis_server.url, PREFIX), clock=clock)
    two = ResponseStore(RedisResponseBackend(redis_server.url, PREFIX), clock=clock)
    (r1,) = chain(one, "k", 1, expires=clock.now + 60)
    r2 = stored("k", conversation_of(r1.response_id), r1)
    two.add(r2, clock.now + 60)                     # replica two continues it
    assert [r.response_id for r in one.history(one.get(r2.response_id, "k"))] == [r1.response_id,
                                                                                   r2.response_id]
    two.delete(r1)
    with pytest.raises(SessionError):
        one.get(r1.response_id, "k")                # read again on use: deleted elsewhere
    key = one.backend.key("k", conversation_of(r1.response_id) or "")      # type: ignore[union-attr]
    assert 0 < redis_server.admin().pttl(key) <= 60_000   # Redis drops it with the conversation


def test_a_loss_another_check_finds_during_the_read_keeps_the_conversation(redis_server: RedisServer) -> None:
    # Another check (the session sweep) finds Redis emptied between this lookup's republish and its
    # read: the read misses, and this lookup's own check sees the marker already set again.
    clock = Clock()
    backend = RedisResponseBackend(redis_server.url, PREFIX)
    store = ResponseStore(backend, clock=clock)
    (r1,) = chain(store, "k", 1, expires=clock.now + 60)
    assert store.get(r1.response_id, "k").to_json() == r1.to_json()      # the marker noted
    real_load = backend.load

    def load_after_another_check(owner, conversation_id):
        redis_server.admin().flushall()
        assert backend.check_data()
        return real_load(owner, conversation_id)

    backend.load = load_after_another_check                 # type: ignore[method-assign]
    assert store.get(r1.response_id, "k").to_json() == r1.to_json()      # kept, and republished
    backend.load = real_load                                 # type: ignore[method-assign]
    assert ResponseStore(backend, clock=clock).get(r1.response_id, "k").to_json() == r1.to_json()


def test_a_turn_stored_after_redis_lost_its_data_keeps_the_whole_conversation(redis_server: RedisServer) -> None:
    # Redis emptied, then a new turn writes a record that holds only itself: the earlier responses
    # held here stay, and the whole conversation is republished.
    clock = Clock()
    backend = RedisResponseBackend(redis_server.url, PREFIX)
    store = ResponseStore(backend, clock=clock)
    r1, r2 = chain(store, "k", 2, expires=clock.now + 60)
    assert store.get(r2.response_id, "k").to_json() == r2.to_json()      # the marker noted
    redis_server.admin().flushall()
    r3 = stored("k", conversation_of(r1.response_id), r2)
    store.add(r3, clock.now + 60)
    got = store.get(r3.response_id, "k")
    assert [r.response_id for r in store.history(got)] == [r1.response_id, r2.response_id, r3.response_id]
    other = ResponseStore(RedisResponseBackend(redis_server.url, PREFIX), clock=clock)
    assert len(other.history(other.get(r3.response_id, "k"))) == 3
