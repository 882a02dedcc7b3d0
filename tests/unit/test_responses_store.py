"""The stored-response store (``kvhive.sessions.response_store``) and its file backend, without a model or a server."""

from __future__ import annotations

import os
import time

import pytest
from support.responses import Clock, assert_backend_persists, chain, reopened, stored

from kvhive.sessions.registry import SessionError, SessionLimit, SessionNotFound
from kvhive.sessions.response_backends import FileResponseBackend
from kvhive.sessions.response_store import (
    ResponseStats,
    ResponseStore,
    conversation_of,
    new_conversation_id,
    new_response_id,
)


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
    assert isinstance(other.value, SessionNotFound) and other.value.code == "response_not_found"
    with pytest.raises(SessionError) as previous:
        store.get("resp_" + "0" * 48, "alice", "previous_response_id")
    assert (previous.value.code, previous.value.param) == ("previous_response_not_found", "previous_response_id")
    conversation = conversation_of(r1.response_id)
    assert conversation is not None
    with pytest.raises(SessionError) as full:
        store.check_room(conversation, "alice")
    assert isinstance(full.value, SessionLimit) and full.value.code == "too_many_responses"
    store.check_room(conversation, "bob")               # bob's conversation of that id is empty
    # Deleting the middle breaks what continues it; the rest of the conversation stays.
    assert store.delete(r2) is False
    with pytest.raises(SessionError) as broken:
        store.history(r3)
    assert isinstance(broken.value, SessionNotFound)
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


def test_the_file_backend_persists_adds_deletes_and_expiry(tmp_path) -> None:
    assert_backend_persists(FileResponseBackend(str(tmp_path)))


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
