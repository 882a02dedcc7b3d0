"""SessionRegistry without a model over a real redis-server shared by two registries (two
replicas): sessions move between them, survive Redis going down and Redis losing its data."""

from __future__ import annotations

import time

import pytest
from support.redis_server import RedisServer
from support.sessions import BLOCK_SIZE, Pins, hashes, registry, run_turn

from kvhive.sessions.backends import RedisBackend
from kvhive.sessions.registry import SessionBusy, SessionError, SessionNotFound
from kvhive.store.redis_keys import RedisKeys

PREFIX = RedisKeys("m").sessions           # the session keys of a replica serving model "m"


@pytest.fixture()
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def test_replicas_do_not_overwrite_each_others_sessions(redis_url):
    one, two = registry(RedisBackend(redis_url, PREFIX)), registry(RedisBackend(redis_url, PREFIX))
    a = run_turn(one, "k", hashes("a", 2))
    b = run_turn(two, "k", hashes("b", 2))
    run_turn(one, "k", hashes("c", 1))                   # a later write on replica one
    backend = RedisBackend(redis_url, PREFIX)
    assert backend.load("k", a.session_id)["block_hashes"] == a.block_hashes
    assert backend.load("k", b.session_id)["block_hashes"] == b.block_hashes
    # Redis drops the record when the session expires.
    pttl = backend.client.pttl(backend.key("k", a.session_id))
    assert abs(pttl - (a.expires - time.time()) * 1000) < 2000


def test_a_session_moves_between_replicas_through_redis(redis_url):
    pins_one, pins_two = Pins(), Pins()
    one = registry(RedisBackend(redis_url, PREFIX), pins=pins_one)
    s1 = run_turn(one, "k", hashes("a", 3))
    two = registry(RedisBackend(redis_url, PREFIX), pins=pins_two)   # started before or after: no matter
    with pytest.raises(SessionError) as other_key:
        two.get(s1.session_id, "another-key")
    assert isinstance(other_key.value, SessionNotFound)
    s2 = two.get(s1.session_id, "k")                     # not held here: loaded from Redis and pinned
    assert (s2.num_tokens, s2.block_hashes, s2.expires) == (s1.num_tokens, s1.block_hashes, s1.expires)
    assert pins_two.calls == [(s1.engine_id, s1.block_hashes)]
    two.begin_turn(s2, "m", 100)
    two.end_turn(s2, 5 * BLOCK_SIZE, hashes("a", 5))
    # Replica one reads its copy again on use: the history replica two extended, pinned anew.
    again = one.get(s1.session_id, "k")
    assert again is s1 and s1.block_hashes == hashes("a", 5) and s1.expires == s2.expires
    assert pins_one.calls[-1] == (s1.engine_id, hashes("a", 5))
    # A PATCH on one replica is seen by the other.
    one.set_ttl(s1, 900)
    assert two.get(s1.session_id, "k").ttl_s == 900
    # A DELETE on replica two: replica one answers 404 and its sweep frees what it held.
    two.delete(s2)
    with pytest.raises(SessionError):
        one.get(s1.session_id, "k")
    assert one.pop_expired() == [s1]


def test_an_expired_copy_does_not_delete_a_session_another_replica_extended(redis_url):
    one = registry(RedisBackend(redis_url, PREFIX))
    two = registry(RedisBackend(redis_url, PREFIX))
    s1 = run_turn(one, None, hashes("a", 2), ttl=1)
    two.set_ttl(two.get(s1.session_id, None), 600)
    time.sleep(1.1)
    assert one.pop_expired() == [s1]                     # replica one's copy expired: it lets go
    assert one.get(s1.session_id, None).ttl_s == 600     # the record lives on, and loads again


def test_a_busy_session_is_not_reread(redis_url):
    one = registry(RedisBackend(redis_url, PREFIX))
    two = registry(RedisBackend(redis_url, PREFIX))
    s1 = run_turn(one, None, hashes("a", 2))
    one.begin_turn(s1, "m", 50)
    two.delete(two.get(s1.session_id, None))
    assert one.get(s1.session_id, None) is s1            # a turn in progress keeps its session
    with pytest.raises(SessionError) as busy:
        one.begin_turn(s1, "m", 50)
    assert isinstance(busy.value, SessionBusy)


def test_with_redis_down_a_replica_serves_the_sessions_it_holds(redis_server):
    one = registry(RedisBackend(redis_server.url, PREFIX, timeout_s=0.2))
    s1 = run_turn(one, None, hashes("a", 2))
    redis_server.stop()
    assert one.get(s1.session_id, None) is s1
    one.begin_turn(s1, "m", 50)
    one.end_turn(s1, 3 * BLOCK_SIZE, hashes("a", 3))      # the failed save is logged, not raised
    with pytest.raises(SessionError):
        one.get("sess-unknown", None)
    redis_server.start()                                  # back, and empty
    backend = RedisBackend(redis_server.url, PREFIX)
    deadline = time.monotonic() + 10
    while not backend.guard.breaker.allow():              # the breaker's probe finds it back
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # What the replica held (and could not save meanwhile) is written again before the next read.
    assert one.get(s1.session_id, None) is s1
    assert backend.load(None, s1.session_id)["block_hashes"] == hashes("a", 3)
    one.set_ttl(s1, 60)                                   # the next change saves again
    assert backend.load(None, s1.session_id)["ttl"] == 60


def test_a_session_held_here_survives_redis_losing_its_data(redis_server):
    one = registry(RedisBackend(redis_server.url, PREFIX))
    two = registry(RedisBackend(redis_server.url, PREFIX))
    s1 = run_turn(one, None, hashes("a", 2))
    s2 = run_turn(one, None, hashes("b", 2))
    assert two.get(s1.session_id, None).block_hashes == s1.block_hashes
    redis_server.admin().flushall()
    # A miss for a session held here, with the data marker gone: kept, and every held one republished.
    assert one.get(s1.session_id, None) is s1
    backend = RedisBackend(redis_server.url, PREFIX)
    assert {backend.load(None, s.session_id)["id"] for s in (s1, s2)} == {s1.session_id, s2.session_id}
    # With the marker in place, a missing record is a session ended elsewhere, as before.
    two.delete(two.get(s2.session_id, None))
    with pytest.raises(SessionError):
        one.get(s2.session_id, None)


def test_a_loss_another_check_finds_during_the_read_still_keeps_the_session(redis_server):
    # The sweep (or the response store) checks the marker first, between this lookup's republish
    # and its read: the read misses, and this lookup's own check sees the marker already set again.
    one = registry(RedisBackend(redis_server.url, PREFIX))
    s1 = run_turn(one, None, hashes("a", 2))
    assert one.get(s1.session_id, None) is s1       # its record written, the marker noted
    backend = one.backend
    real_load = backend.load

    def load_after_another_check(owner, session_id):
        redis_server.admin().flushall()
        assert backend.check_data()                 # the other check: finds the loss, tells listeners
        return real_load(owner, session_id)

    backend.load = load_after_another_check
    assert one.get(s1.session_id, None) is s1       # kept (not ended), and republished
    assert s1.expires > time.time() + 300
    backend.load = real_load
    assert backend.load(None, s1.session_id)["id"] == s1.session_id


