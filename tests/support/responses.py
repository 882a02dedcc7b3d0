"""Stored responses without a model: a clock the test moves, responses and chains of them, and the
persistence check every response backend passes."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvhive.sessions.registry import SessionError
from kvhive.sessions.response_backends import ResponseBackend
from kvhive.sessions.response_store import (
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


def reopened(backend: ResponseBackend, clock: Clock) -> ResponseStore:
    """A store over the same records, as a restarted server (or another replica) has it."""
    return ResponseStore(backend, clock=clock)


def assert_backend_persists(backend: ResponseBackend) -> None:
    """Adds, deletes and expiries reach ``backend``: a store reopened over it sees them."""
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
    assert backend.load("alice", conversation_of(r1.response_id) or "") is None
    clock.now += 61
    assert reopened(backend, clock).is_empty(conversation_of(other.response_id) or "", None)
