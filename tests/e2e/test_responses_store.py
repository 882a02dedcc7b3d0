"""The stored-response store (``kvhive.sessions.responses``) and its backends, without a model or a server."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_store_redis import RedisServer, _free_port

from kvhive.sessions.registry import SessionError
from kvhive.sessions.response_backends import FileResponseBackend, RedisResponseBackend, ResponseBackend
from kvhive.sessions.responses import (
    ResponseStats,
    ResponseStore,
    StoredResponse,
    conversation_of,
    new_conversation_id,
    new_response_id,
)


class Clock:
    """A clock the test moves; it starts at the real time, which Redis expiries are set against."""

    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


def stored(owner: str | None, conversation: str | None, previous: StoredResponse | None = None,
           text: str = "out") -> StoredResponse:
    response = {"id": new_response_id(conversation), "model": "m", "output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
        "previous_response_id": previous.response_id if previous else None}
    items = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "in"}]}]
    return StoredResponse(owner, response, items)


def chain(store: ResponseStore, owner: str | None, n: int, expires: float) -> list[StoredResponse]:
    conversation = new_conversation_id()
    responses: list[StoredResponse] = []
    for _ in range(n):
        responses.append(stored(owner, conversation, responses[-1] if responses else None))
        store.add(responses[-1], expires)
    return responses


def test_ids_name_their_conversation() -> None:
    conversation = new_conversation_id()
    rid = new_response_id(conversation)
    assert rid.startswith("resp_") and len(rid) == 53 and conversation_of(rid) == conversation
    assert conversation_of(new_response_id(None)) != conversation
    for bad in ("resp_x", "resp_" + "g" * 48, "sess-1", "resp_" + "0" * 49):
        assert conversation_of(bad) is None


def test_get_history_owner_and_bound() -> None:
    clock = Clock()
    store = ResponseStore(max_per_conversation=3, clock=clock)
    r1, r2, r3 = chain(store, "alice", 3, expires=clock.now + 60)
    assert store.get(r3.response_id, "alice") is r3
    assert store.history(r3) == [r1, r2, r3]
    with pytest.raises(SessionError) as other:
        store.get(r3.response_id, "bob")                # another key: as if it did not exist
    assert other.value.status_code == 404 and other.value.code == "response_not_found"
    with pytest.raises(SessionError) as previous:
        store.get("resp_" + "0" * 48, "alice", "previous_response_id")
    assert (previous.value.code, previous.value.param) == ("previous_response_not_found", "previous_response_id")
    conversation = conversation_of(r1.response_id)
    assert conversation is not None
    with pytest.raises(SessionError) as full:
        store.check_room(conversation, "alice")
    assert full.value.status_code == 429 and full.value.code == "too_many_responses"
    store.check_room(conversation, "bob")               # bob's conversation of that id is empty
    # Deleting the middle breaks what continues it; the rest of the conversation stays.
    assert store.delete(r2) is False
    with pytest.raises(SessionError) as broken:
        store.history(r3)
    assert broken.value.status_code == 404
    assert store.history(r1) == [r1]
    store.check_room(conversation, "alice")
    assert store.delete(r1) is False and store.delete(r3) is True      # the last one empties it
    assert store.is_empty(conversation, "alice") and store.num_responses() == 0


def test_conversations_expire_whole_and_each_turn_moves_the_expiry() -> None:
    clock = Clock()
    store = ResponseStore(clock=clock)
    start = clock.now
    r1, r2 = chain(store, None, 2, expires=start + 10)
    later = chain(store, None, 1, expires=start + 100)
    store.add(stored(None, conversation_of(r1.response_id), r2), expires=start + 20)    # a new turn slides it
    clock.now = start + 15
    assert store.pop_expired() == [] and store.get(r1.response_id, None) is r1
    clock.now = start + 20
    with pytest.raises(SessionError):
        store.get(r1.response_id, None)                 # expired, not swept yet: already gone
    (expired,) = store.pop_expired()
    assert expired.conversation_id == conversation_of(r1.response_id) and len(expired.responses) == 3
    assert store.get(later[0].response_id, None) is later[0]
    assert store.stats() == ResponseStats(num_stored=1, num_conversations=1)


def test_stats_count_responses_and_conversations_through_deletes() -> None:
    store = ResponseStore()
    a1, a2 = chain(store, "alice", 2, expires=time.time() + 60)
    (b1,) = chain(store, "bob", 1, expires=time.time() + 60)
    assert store.stats() == ResponseStats(num_stored=3, num_conversations=2)
    assert store.delete(a2) is False and store.stats() == ResponseStats(2, 2)
    assert store.delete(a1) is True and store.stats() == ResponseStats(1, 1)
    assert store.delete(b1) is True and store.stats() == ResponseStats(0, 0)


@pytest.fixture(params=["file", "redis"])
def backend(request, tmp_path) -> Iterator[ResponseBackend]:
    if request.param == "file":
        yield FileResponseBackend(str(tmp_path))
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(_free_port(), str(tmp_path))
    server.start()
    yield RedisResponseBackend(server.url, "kvhive:responses")
    server.stop()


def reopened(backend: ResponseBackend, clock: Clock) -> ResponseStore:
    """A store over the same records, as a restarted server (or another replica) has it."""
    return ResponseStore(backend, clock=clock)


def test_backends_persist_adds_deletes_and_expiry(backend: ResponseBackend) -> None:
    clock = Clock()
    store = ResponseStore(backend, clock=clock)
    r1, r2, r3 = chain(store, "alice", 3, expires=clock.now + 60)
    other = chain(store, None, 1, expires=clock.now + 60)[0]
    store.delete(r2)
    again = reopened(backend, clock)
    got: dict[str, Any] = {r.response_id: again.get(r.response_id, "alice").to_json() for r in (r1, r3)}
    assert got == {r1.response_id: r1.to_json(), r3.response_id: r3.to_json()}
    with pytest.raises(SessionError):
        again.get(r2.response_id, "alice")
    assert again.get(other.response_id, None).to_json() == other.to_json()
    # Deleting the rest drops the conversation's record as a whole.
    assert again.delete(r1) is False and again.delete(r3) is True
    assert backend.load_conversation("alice", conversation_of(r1.response_id) or "") is None
    clock.now += 61
    assert reopened(backend, clock).is_empty(conversation_of(other.response_id) or "", None)


@pytest.fixture()
def redis_server(tmp_path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(_free_port(), str(tmp_path))
    server.start()
    yield server
    server.stop()


def test_a_shared_backend_sees_other_replicas_turns(redis_server: RedisServer) -> None:
    clock = Clock()
    one = ResponseStore(RedisResponseBackend(redis_server.url, "kvhive:responses"), clock=clock)
    two = ResponseStore(RedisResponseBackend(redis_server.url, "kvhive:responses"), clock=clock)
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
    backend = RedisResponseBackend(redis_server.url, "kvhive:responses")
    store = ResponseStore(backend, clock=clock)
    (r1,) = chain(store, "k", 1, expires=clock.now + 60)
    assert store.get(r1.response_id, "k").to_json() == r1.to_json()      # the marker noted
    real_load = backend.load_conversation

    def load_after_another_check(owner, conversation_id):
        redis_server.admin().flushall()
        assert backend.check_data()
        return real_load(owner, conversation_id)

    backend.load_conversation = load_after_another_check                 # type: ignore[method-assign]
    assert store.get(r1.response_id, "k").to_json() == r1.to_json()      # kept, and republished
    backend.load_conversation = real_load                                 # type: ignore[method-assign]
    assert ResponseStore(backend, clock=clock).get(r1.response_id, "k").to_json() == r1.to_json()


def test_a_turn_stored_after_redis_lost_its_data_keeps_the_whole_conversation(redis_server: RedisServer) -> None:
    # Redis emptied, then a new turn writes a record that holds only itself: the earlier responses
    # held here stay, and the whole conversation is republished.
    clock = Clock()
    backend = RedisResponseBackend(redis_server.url, "kvhive:responses")
    store = ResponseStore(backend, clock=clock)
    r1, r2 = chain(store, "k", 2, expires=clock.now + 60)
    assert store.get(r2.response_id, "k").to_json() == r2.to_json()      # the marker noted
    redis_server.admin().flushall()
    r3 = stored("k", conversation_of(r1.response_id), r2)
    store.add(r3, clock.now + 60)
    got = store.get(r3.response_id, "k")
    assert [r.response_id for r in store.history(got)] == [r1.response_id, r2.response_id, r3.response_id]
    other = ResponseStore(RedisResponseBackend(redis_server.url, "kvhive:responses"), clock=clock)
    assert len(other.history(other.get(r3.response_id, "k"))) == 3


def test_a_corrupt_record_is_skipped(tmp_path) -> None:
    backend = FileResponseBackend(str(tmp_path))
    clock = Clock()
    store = ResponseStore(backend, clock=clock)
    (good,) = chain(store, None, 1, expires=clock.now + 60)
    (bad,) = chain(store, None, 1, expires=clock.now + 60)
    directory = os.path.join(backend.directory, os.listdir(backend.directory)[0])
    victim = bad if os.path.exists(os.path.join(directory, f"{bad.response_id}.json")) else good
    with open(os.path.join(directory, f"{victim.response_id}.json"), "w") as f:
        f.write("{not json")
    again = reopened(backend, clock)
    survivor = good if victim is bad else bad
    assert again.get(survivor.response_id, None).to_json() == survivor.to_json()
    with pytest.raises(SessionError):
        again.get(victim.response_id, None)
