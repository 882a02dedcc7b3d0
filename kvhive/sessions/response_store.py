"""Stored responses of ``/v1/responses``, grouped in conversations (torch-free).

A conversation is the tree of responses linked by ``previous_response_id``; its KV lives in one
session of the ``SessionRegistry`` whose id is the conversation's id, so each turn continues the
KV of the turn before it. This module holds only the records; the server runs the turns.

Rules, in one place:

- Ids: a conversation is ``conv-<24 hex>`` (its session has that id); a response is
  ``resp_<the conversation's 24 hex><24 hex of its own>``, so a response id names its
  conversation without an index (a replica sharing Redis finds it by id alone).
- Keys: conversations are keyed by (owner, id); another API key's response is not found.
- Lifetime: a conversation lives until ``expires``, which each stored turn sets to its session's
  expiry (now + the session's TTL): a conversation and its session expire together, and all its
  responses live as long as its newest turn, so expiry never breaks a conversation in the middle.
- Bound: at most ``max_per_conversation`` responses per conversation (more are refused). Each
  conversation is a session, so ``--max-sessions-per-key`` bounds the conversations of a key.
- Delete removes one response; the caller ends the session when its conversation has no response
  left. A response whose history lost a response to DELETE cannot be continued (not found).
- Persistence (``kvhive.sessions.response_backends``, through ``kvhive.sessions.expiring``, the
  store it shares with sessions, a conversation being its record): each stored turn writes its record and the
  conversation's expiry; a local backend that cannot (a full disk) refuses the turn's storing
  (SessionNotDurable) and holds nothing new. A local backend is loaded whole at start; a shared one (Redis) is read
  again on each use, since another replica may have added responses or deleted some since. The
  server reads it off the event loop (``aget``, ``ais_empty``). When it may lack what is held here
  (its Redis breaker closed after an outage, or Redis lost its data), every live conversation held
  here is written again before the next read; a conversation held here whose responses are missing
  from a Redis that lost its data (gone, or only a turn stored since) is kept and republished.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvhive.core.failure_log import FailureLog
from kvhive.sessions.expiring import BackendRead, ExpiringStore
from kvhive.sessions.registry import SessionLimit, SessionNotFound
from kvhive.sessions.response_backends import ResponseBackend

# Stored responses of one conversation (a tree of branches from one first turn): with the context
# length, this bounds the text one conversation keeps.
MAX_RESPONSES_PER_CONVERSATION = 1000

_RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{24})[0-9a-f]{24}$")


def new_conversation_id() -> str:
    """A fresh conversation id (also the id of the session that holds its KV)."""
    return f"conv-{uuid.uuid4().hex[:24]}"


def new_response_id(conversation_id: str | None) -> str:
    """A fresh response id in the conversation (None: a response that is not stored)."""
    prefix = conversation_id[len("conv-"):] if conversation_id else uuid.uuid4().hex[:24]
    return f"resp_{prefix}{uuid.uuid4().hex[:24]}"


def conversation_of(response_id: str) -> str | None:
    """The conversation a response id names, or None for an id kvhive never hands out."""
    match = _RESPONSE_ID.match(response_id)
    return None if match is None else f"conv-{match.group(1)}"


def _response_ids(record: dict[str, Any] | None) -> set[str]:
    """The ids of the responses in a backend record (none for no record or a corrupt one)."""
    try:
        return {item["response"]["id"] for item in record["responses"]} if record is not None else set()
    except (KeyError, TypeError):
        return set()


def response_not_found(response_id: str, param: str | None = None) -> SessionNotFound:
    """An id that is unknown, expired, deleted, not stored or another key's."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "response_not_found"
    return SessionNotFound(f"{what} with id '{response_id}' not found (unknown, expired, deleted, "
                           f"or created with store: false)", code, param)


@dataclass(frozen=True)
class ResponseStats:
    """A snapshot for metrics: what the store holds, and the responses created since start by status."""

    num_stored: int                    # stored responses (live or not yet swept)
    num_conversations: int             # conversations holding them
    created_total: dict[str, int] = field(default_factory=dict)   # completed, incomplete, failed
    write_errors_total: int = 0        # responses a local backend could not write (SessionNotDurable)


@dataclass
class StoredResponse:
    """One stored response: the object GET answers, and the input items of its request."""

    owner: str | None
    response: dict[str, Any]           # the response object, as served
    input_items: list[dict[str, Any]]  # this request's input items (messages), as listed
    # Hex hashes of the full blocks of its prompt and output, when its session turn recorded them
    # (``kvhive.sessions.chain_pins`` pins them); empty: none known.
    chain: list[str] = field(default_factory=list)

    @property
    def response_id(self) -> str:
        """The response's id."""
        return self.response["id"]

    @property
    def model(self) -> str:
        """The model that wrote it."""
        return self.response["model"]

    @property
    def previous_response_id(self) -> str | None:
        """The response it continued, or None for a first turn."""
        return self.response.get("previous_response_id")

    def to_json(self) -> dict[str, Any]:
        """The persisted record."""
        record = {"owner": self.owner, "response": self.response, "input_items": self.input_items}
        if self.chain:
            record["chain"] = self.chain
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StoredResponse:
        """Inverse of ``to_json``."""
        return cls(record["owner"], dict(record["response"]), list(record["input_items"]),
                   [str(h) for h in record.get("chain", [])])


@dataclass
class Conversation:
    """The stored responses of one conversation and when they expire."""

    conversation_id: str
    owner: str | None
    expires: float                     # unix time: the expiry of its session after the newest turn
    responses: dict[str, StoredResponse] = field(default_factory=dict)

    @property
    def record_id(self) -> str:
        """Its id in the record store (``kvhive.sessions.expiring``)."""
        return self.conversation_id

    @property
    def written(self) -> bool:
        """Whether a republish writes it: only while it stores a response."""
        return bool(self.responses)

    def is_live(self, now: float) -> bool:
        """Not expired at ``now``."""
        return self.expires > now

    def can_sweep(self, now: float) -> bool:
        """Expired at ``now``."""
        return self.expires <= now

    def to_json(self) -> dict[str, Any]:
        """The persisted record: id, owner, expiry and every response."""
        return {"id": self.conversation_id, "owner": self.owner, "expires": self.expires,
                "responses": [r.to_json() for r in self.responses.values()]}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Conversation:
        """Inverse of ``to_json`` (KeyError, TypeError, ValueError for a corrupt record)."""
        conversation = cls(record["id"], record["owner"], float(record["expires"]))
        for item in record["responses"]:
            stored = StoredResponse.from_json(item)
            conversation.responses[stored.response_id] = stored
        return conversation


class ResponseStore:
    """Stored responses by (owner, conversation), with expiry, a bound and persistence."""

    def __init__(self, backend: ResponseBackend | None = None,
                 max_per_conversation: int = MAX_RESPONSES_PER_CONVERSATION,
                 clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.max_per_conversation = max_per_conversation
        self.clock = clock
        # A local backend's conversations are held from here on (expired ones for the sweep to
        # drop); a shared one's are read on use.
        self.conversations: ExpiringStore[Conversation] = ExpiringStore(
            backend, Conversation.from_json, "conversation", "stored responses", clock)

    @property
    def write_failures(self) -> FailureLog:
        """Responses a local backend could not write."""
        return self.conversations.write_failures

    def get(self, response_id: str, owner: str | None, param: str | None = None) -> StoredResponse:
        """The caller's live stored response; SessionNotFound otherwise (``param`` names the field).
        Blocks on a shared backend (the server calls ``aget``)."""
        return self._found(self._conversation(conversation_of(response_id), owner), response_id, param)

    async def aget(self, response_id: str, owner: str | None, param: str | None = None) -> StoredResponse:
        """``get`` with the backend read on a worker thread, off the event loop."""
        conversation = await self._aconversation(conversation_of(response_id), owner)
        return self._found(conversation, response_id, param)

    @staticmethod
    def _found(conversation: Conversation | None, response_id: str, param: str | None) -> StoredResponse:
        stored = None if conversation is None else conversation.responses.get(response_id)
        if stored is None:
            raise response_not_found(response_id, param)
        return stored

    def history(self, stored: StoredResponse) -> list[StoredResponse]:
        """The responses from the first turn of ``stored``'s conversation to ``stored`` itself;
        SessionNotFound when one of them was deleted."""
        conversation = self.conversations.held(stored.owner, conversation_of(stored.response_id) or "")
        responses = {} if conversation is None else conversation.responses
        chain = [stored]
        while chain[-1].previous_response_id is not None:
            previous = responses.get(chain[-1].previous_response_id)
            if previous is None or len(chain) > len(responses):
                raise SessionNotFound(f"Response '{stored.response_id}' continues response "
                                      f"'{chain[-1].previous_response_id}', which was deleted: its "
                                      f"conversation cannot be continued", "previous_response_not_found",
                                      "previous_response_id")
            chain.append(previous)
        return chain[::-1]

    def check_room(self, conversation_id: str, owner: str | None) -> None:
        """SessionLimit when the conversation already holds ``max_per_conversation`` responses."""
        conversation = self.conversations.held(owner, conversation_id)
        if conversation is not None and len(conversation.responses) >= self.max_per_conversation:
            raise SessionLimit(f"Conversation '{conversation_id}' already stores "
                               f"{self.max_per_conversation} responses; delete some, or start a new "
                               f"conversation (a request without previous_response_id)",
                               "too_many_responses", "previous_response_id")

    def add(self, stored: StoredResponse, expires: float) -> None:
        """Store a response in its conversation, whose expiry becomes ``expires``. A local backend
        that cannot write it (a full disk, an I/O error) raises SessionNotDurable, and nothing
        changes; failures are logged once per interval."""
        conversation_id = conversation_of(stored.response_id)
        assert conversation_id is not None, stored.response_id
        backend = self.backend
        if backend is not None:
            self.conversations.write(f"response '{stored.response_id}'", lambda: backend.save_response(
                stored.owner, conversation_id, expires, stored.to_json()))
        conversation = self.conversations.held(stored.owner, conversation_id)
        if conversation is None:
            conversation = Conversation(conversation_id, stored.owner, expires)
            self.conversations.hold(conversation)
        conversation.expires = expires
        conversation.responses[stored.response_id] = stored

    def delete(self, stored: StoredResponse) -> bool:
        """Forget one response, here and in the backend; True when its conversation is now empty
        (and forgotten too: the caller ends its session)."""
        owner, response_id = stored.owner, stored.response_id
        conversation_id = conversation_of(response_id) or ""
        conversation = self.conversations.held(owner, conversation_id)
        if conversation is not None:
            conversation.responses.pop(response_id, None)
        empty = conversation is None or not conversation.responses
        if empty and conversation is not None:
            self.conversations.release(conversation)
        backend = self.backend
        if backend is not None and empty:
            self.conversations.delete_quietly(f"conversation {conversation_id}",
                                              lambda: backend.delete(owner, conversation_id))
        elif backend is not None:
            self.conversations.delete_quietly(f"response {response_id}",
                                              lambda: backend.delete_response(owner, conversation_id, response_id))
        return empty

    def is_empty(self, conversation_id: str, owner: str | None) -> bool:
        """True when the conversation stores no response (here, and in a shared backend)."""
        conversation = self._conversation(conversation_id, owner)
        return conversation is None or not conversation.responses

    async def ais_empty(self, conversation_id: str, owner: str | None) -> bool:
        """``is_empty`` with the backend read on a worker thread, off the event loop."""
        conversation = await self._aconversation(conversation_id, owner)
        return conversation is None or not conversation.responses

    def pop_expired(self) -> list[Conversation]:
        """Remove and return the expired conversations (a local backend's records go too; a shared
        backend's expire in Redis on their own)."""
        return self.conversations.pop_expired()

    def live_responses(self) -> list[StoredResponse]:
        """The stored responses of the live conversations held here, oldest conversation first."""
        return [r for c in sorted(self.conversations.live(), key=lambda c: c.expires) for r in c.responses.values()]

    def num_responses(self) -> int:
        """Stored responses this replica holds (live or not yet swept)."""
        return sum(len(c.responses) for c in self.conversations)

    def stats(self) -> ResponseStats:
        """The responses and conversations this replica holds (live or not yet swept)."""
        return ResponseStats(self.num_responses(), self.conversations.count(),
                             write_errors_total=self.write_failures.total)

    # ------------------------------------------------------------------ persistence

    def _conversation(self, conversation_id: str | None, owner: str | None) -> Conversation | None:
        """The live conversation; with a shared backend, as the backend has it now (blocking)."""
        if conversation_id is None:
            return None
        if self.conversations.rereads:
            read = self.conversations.fetch(owner, conversation_id, self._lacks(owner, conversation_id))
            self._apply(owner, conversation_id, read)
        return self._live(owner, conversation_id)

    async def _aconversation(self, conversation_id: str | None, owner: str | None) -> Conversation | None:
        """``_conversation`` with the backend read on a worker thread."""
        if conversation_id is None:
            return None
        if self.conversations.rereads:
            read = await self.conversations.afetch(owner, conversation_id, self._lacks(owner, conversation_id))
            self._apply(owner, conversation_id, read)
        return self._live(owner, conversation_id)

    def _live(self, owner: str | None, conversation_id: str) -> Conversation | None:
        conversation = self.conversations.held(owner, conversation_id)
        return conversation if conversation is not None and conversation.is_live(self.clock()) else None

    def _lacks(self, owner: str | None, conversation_id: str) -> Callable[[dict[str, Any] | None], bool]:
        """Whether a backend record lacks responses the conversation held here has (when it is
        read): deleted by another replica, or lost with Redis's data (then a turn stored since
        wrote a record holding only itself)."""
        def lacks(record: dict[str, Any] | None) -> bool:
            held = self.conversations.held(owner, conversation_id)
            return held is not None and not held.responses.keys() <= _response_ids(record)
        return lacks

    def _apply(self, owner: str | None, conversation_id: str, read: BackendRead) -> None:
        """Hold the conversation as the backend has it (``read.lost``: as held here, republished)."""
        if read.lost:
            self.republish_if_wanted()
            return
        conversation = self.conversations.parse(read.record)
        held = self.conversations.held(owner, conversation_id)
        if conversation is not None:
            self.conversations.hold(conversation)
        elif held is not None:
            self.conversations.release(held)

    def republish_if_wanted(self) -> int:
        """Write every live conversation held here again, if the backend may lack them; how many."""
        return self.conversations.republish_if_wanted()

    async def check_backend(self) -> None:
        """Ask a shared backend whether it lost its data (off the event loop); republish if so."""
        await self.conversations.check_backend()
