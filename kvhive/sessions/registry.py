"""The session registry: ids, owners, TTLs and sliding expiry, limits, and persistence (torch-free).

A session (a ``/v1/context`` cache or a chat ``conversation_id``) is one record here plus the
blocks the engine holds for it under ``Session.engine_id`` (see ``kvhive.kv.manager``). The
registry lives on the server's event loop; the engine is told only to pin and free a session's
blocks (``on_load`` pins the blocks of a session taken from the backend). Beside it:
``session.py`` (the record, id and TTL checks), ``errors.py`` (the error kinds), ``limits.py``
(the per-key and keeper-tier limits) and ``expiring.py`` (the record store: held records, the
backend's writes and reads, the expiry sweep).

Rules, in one place:

- Sessions are keyed by (owner, id): another API key's session is not found, and a
  ``conversation_id`` that another key also uses names a different session.
- Expiry is sliding: each finished turn sets ``expires = now + ttl``; TTLs are whole seconds in
  (0, max_ttl]. A session busy with a turn never expires under it.
- One turn at a time: a second request on a busy session is refused (busy), nothing changes.
- Limits: per key (``--max-sessions-per-key``, ``--max-pinned-gb``: by default half the room
  sessions may pin) and server-wide (the blocks of all sessions must fit in the keeper tier that
  pins them, less ``KEEPER_MARGIN``); a request over one is refused before anything changes.
- Persistence (``kvhive.sessions.backends``, through the store ``kvhive.sessions.expiring``
  shares with stored responses): every change writes that session's record. A local backend (disk
  dir) is loaded whole at start. A write it cannot make (a full disk) raises SessionNotDurable and
  leaves its old record: a new session is not created, a TTL not changed. A shared one (Redis) is
  the truth for every replica: a session this replica does not hold is loaded on first use, and
  one it holds is read again on each use (another replica may have extended, re-TTL'd or deleted it).
- Across replicas the busy rule is per process: two replicas running a turn on one session at
  once (the gateway sends a session to one replica, so only around a failover) both succeed, and
  the last turn to end wins the record; the other turn's history is lost to the session.
- Per-key limits count the sessions this replica holds; with a gateway they hold per replica.
- Redis losing data never loses a session this replica holds: when a shared backend may lack
  records held here (its breaker closed after an outage, during which writes were dropped; or
  ``check_data`` found Redis emptied), every live session held here is written again before the
  next read. A record missing from Redis for a session held here means "ended elsewhere" only
  while Redis still has its data; otherwise the session is kept and republished.
- The server reads a shared backend off the event loop (``aget``); writes are queued by the
  backend, not waited for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhive.config import SessionConfig
from kvhive.sessions.backends import SessionBackend
from kvhive.sessions.errors import (
    SessionBusy,
    SessionError,
    SessionInvalid,
    SessionLimit,
    SessionNotDurable,
    SessionNotFound,
    SessionStale,
    not_found,
)
from kvhive.sessions.expiring import BackendRead, ExpiringStore
from kvhive.sessions.limits import KEEPER_MARGIN, KeeperTier, SessionLimits, format_bytes
from kvhive.sessions.session import (
    MAX_SESSION_ID_CHARS,
    SESSION_ID_PATTERN,
    SESSION_KIND,
    Session,
    check_session_id,
    parse_ttl,
)

# The session vocabulary stays importable from here, where the server and the service take it.
__all__ = ["KEEPER_MARGIN", "MAX_SESSION_ID_CHARS", "SESSION_ID_PATTERN", "KeeperTier", "Session", "SessionBusy",
           "SessionError", "SessionInvalid", "SessionLimit", "SessionNotDurable", "SessionNotFound",
           "SessionRegistry", "SessionStale", "SessionStats", "check_session_id", "format_bytes", "not_found", "parse_ttl"]

@dataclass(frozen=True)
class SessionStats:
    """A snapshot of the registry for metrics; the ``*_total`` fields are cumulative since start."""

    num_live: int                  # sessions not expired (busy ones included)
    num_tokens: int                # tokens the live sessions hold
    num_blocks: int                # full blocks of those tokens (a block two sessions share counts twice)
    turns_total: int = 0           # turns finished in a session
    hit_tokens_total: int = 0      # prompt tokens of those turns served from cached KV
    expired_total: int = 0         # sessions dropped at their expiry
    deleted_total: int = 0         # sessions ended by DELETE or end_conversation
    record_write_errors_total: int = 0   # session records a local backend could not write (SessionNotDurable)
    forks_total: int = 0           # sessions made by a fork
    evicted_total: int = 0         # idle conversations ended for a new one (--max-active-conversations)


class SessionRegistry:
    """Session records by (owner, id), with sliding expiry, limits and persistence."""

    def __init__(self, config: SessionConfig, block_bytes: int, block_size: int,
                 backend: SessionBackend | None = None, keeper: KeeperTier | None = None,
                 on_load: Callable[[Session], None] | None = None,
                 clock: Callable[[], float] = time.time, device_pool_bytes: int | None = None) -> None:
        """``keeper`` and ``device_pool_bytes`` size the limits (``kvhive.sessions.limits``)."""
        self.config = config
        self.limits = SessionLimits(config, block_bytes, block_size, keeper, device_pool_bytes)
        self.backend = backend
        self.on_load = on_load
        self.clock = clock
        # A local backend's sessions are held from here on (expired ones for the sweep to drop); a
        # shared one's load on use.
        self.store: ExpiringStore[Session] = ExpiringStore(backend, Session.from_json, "session",
                                                           "session records", clock)
        self._turns = self._hit_tokens = self._expired = self._deleted = 0
        self._forks = self._evicted = 0
        now = clock()
        for session in self.store:
            self._count_blocks(session, session.block_hashes, 1)
            if session.expires > now:
                self._pin(session)

    # ------------------------------------------------------------------ lookups

    def get(self, session_id: str, owner: str | None) -> Session:
        """The caller's live session; SessionNotFound if unknown, expired, deleted or another key's.

        With a shared backend, an idle session is read from it again (and one this replica does
        not hold yet is loaded and pinned); this blocks on the backend (the server calls ``aget``)."""
        session = self.store.held(owner, session_id)
        if self._rereads(session):
            read = self.store.fetch(owner, session_id, self._lacks(session))
            session = self._apply(session, read)
        return self._live(session, session_id)

    async def aget(self, session_id: str, owner: str | None) -> Session:
        """``get`` with the backend read on a worker thread, off the event loop."""
        session = self.store.held(owner, session_id)
        if self._rereads(session):
            read = await self.store.afetch(owner, session_id, self._lacks(session))
            session = self._apply(self.store.held(owner, session_id), read)
        return self._live(session, session_id)

    def _rereads(self, session: Session | None) -> bool:
        """Whether a lookup reads the backend again: shared, and the session not busy here (nor
        held in memory only: the backend never has its record)."""
        return self.store.rereads and (session is None or not (session.busy or session.in_memory))

    @staticmethod
    def _lacks(held: Session | None) -> Callable[[dict[str, Any] | None], bool]:
        """Whether a backend record lacks the session held here: it has none of it."""
        return lambda record: held is not None and record is None

    def _live(self, session: Session | None, session_id: str) -> Session:
        if session is None or not session.is_live(self.clock()):
            raise not_found(session_id)
        return session

    def list(self, owner: str | None) -> list[Session]:
        """The caller's live sessions on this replica, oldest first."""
        now = self.clock()
        return sorted((s for s in self.store.owned(owner) if s.is_live(now)), key=lambda s: s.created)

    def holds(self, session: Session) -> bool:
        """Whether this record is the one held under its (owner, id): not deleted, swept or replaced."""
        return self.store.holds(session)

    def live_sessions(self) -> list[Session]:
        """Every owner's live sessions."""
        return self.store.live()

    def stats(self) -> SessionStats:
        """Live sessions, what they hold, and the cumulative counters."""
        live = self.live_sessions()
        return SessionStats(len(live), sum(s.num_tokens for s in live), sum(len(s.block_hashes) for s in live),
                            self._turns, self._hit_tokens, self._expired, self._deleted,
                            self.store.write_failures.total, self._forks, self._evicted)

    def pinned_bytes(self, owner: str | None) -> int:
        """KV bytes the owner's sessions hold."""
        return self.limits.pinned_bytes(self.store.owned(owner))

    def pinned_block_bytes(self, exclude: Session | None = None) -> int:
        """Bytes of the distinct full blocks all sessions pin (less those only ``exclude`` pins)."""
        return self.limits.pinned_block_bytes(exclude)

    def owned(self, owner: str | None) -> list[Session]:
        """The owner's sessions held here, expired ones included (what its limits count)."""
        return list(self.store.owned(owner))

    # ------------------------------------------------------------------ changes

    def create(self, owner: str | None, model: str, ttl_s: int, session_id: str | None = None,
               kind: str = SESSION_KIND, num_tokens: int = 0, in_memory: bool = False,
               conversation: bool = False) -> Session:
        """A new busy session (its first turn is about to run) of ``kind``, counting ``num_tokens``
        until its turn ends (``in_memory``: a record never written, whose blocks no store tier
        keeps); SessionLimit over the per-key count limit. ``conversation``: made by a
        ``conversation_id`` (``--max-active-conversations`` counts it)."""
        if self.config.max_sessions_per_key is not None:
            self.limits.check_session_count(len(self.list(owner)))
        now = self.clock()
        session = Session(session_id or f"sess-{uuid.uuid4().hex}", owner, model, ttl_s, now, now + ttl_s,
                          num_tokens, busy=True, turn=1, kind=kind, in_memory=in_memory, conversation=conversation)
        self.store.save(session)              # SessionNotDurable: refused before it exists
        self._add(session)
        return session

    def fork(self, parent: Session, ttl_s: int, turn: int | None = None) -> Session:
        """A new idle session of the parent's owner and model holding what the parent held after
        ``turn`` (None: its latest turn), with its own id and TTL. Refused before anything changes:
        SessionInvalid for a turn it cannot name, SessionLimit over the per-key limits (its blocks
        are the parent's, so the keeper tier pins no more), SessionNotDurable."""
        num_tokens = parent.tokens_after(turn)
        num_turns = parent.num_turns if turn is None else turn
        if self.config.max_sessions_per_key is not None:
            self.limits.check_session_count(len(self.list(parent.owner)))
        self.limits.check_key_limit(parent.owner, self.store.owned(parent.owner), num_tokens)
        first = parent.num_turns - len(parent.turn_ends) + 1
        now = self.clock()
        child = Session(f"sess-{uuid.uuid4().hex}", parent.owner, parent.model, ttl_s, now, now + ttl_s,
                        num_tokens, parent.block_hashes[:num_tokens // self.limits.block_size],
                        num_turns=num_turns, turn_ends=parent.turn_ends[:max(0, num_turns - first + 1)])
        self.store.save(child)                # SessionNotDurable: refused before it exists
        self._add(child)
        self._forks += 1
        return child

    def idle_conversation_to_evict(self) -> Session | None:
        """With ``--max-active-conversations`` N and N live conversations: the least recently used
        idle one, for the caller to end (None: room for one more); SessionLimit when all are busy."""
        limit = self.config.max_active_conversations
        if limit is None:
            return None
        live = [s for s in self.live_sessions() if s.conversation]
        if len(live) < limit:
            return None
        idle = [s for s in live if not s.busy]
        if not idle:
            raise SessionLimit(f"This server already runs {limit} conversations, all busy with a turn "
                               f"(--max-active-conversations); retry when one has finished",
                               "too_many_conversations")
        return min(idle, key=lambda s: s.expires - s.ttl_s)      # the least recently used

    def begin_turn(self, session: Session, model: str, new_tokens: int) -> None:
        """Mark the session busy for one turn: SessionInvalid for another model, SessionBusy if busy,
        SessionLimit over bytes."""
        if session.is_pin:
            raise not_found(session.session_id)           # a pin is never run in
        if session.model != model:
            raise SessionInvalid(f"Session '{session.session_id}' holds KV of model "
                                 f"'{session.model}', not '{model}'", "session_model_mismatch", "model")
        if session.busy:
            raise SessionBusy(f"Session '{session.session_id}' is busy with another request; "
                              f"send one request at a time per session", "session_busy")
        self.check_pinned(session.owner, new_tokens, exclude=session)
        session.busy = True
        session.turn += 1

    def check_pinned(self, owner: str | None, num_tokens: int, exclude: Session | None = None,
                     keeper_tokens: int | None = None) -> None:
        """SessionLimit when a session holding ``num_tokens`` (prompt + max_tokens) in place of ``exclude``
        would take the owner's sessions over --max-pinned-gb, or all sessions over the keeper tier
        (``keeper_tokens``: the tokens of new distinct blocks there, when fewer than ``num_tokens``)."""
        self.limits.check_pinned(owner, self.store.owned(owner), num_tokens, exclude, keeper_tokens)

    def check_session_count(self, owner: str | None, num_new: int) -> None:
        """SessionLimit when the owner may not create ``num_new`` more sessions (--max-sessions-per-key)."""
        if num_new > 0 and self.config.max_sessions_per_key is not None:
            self.limits.check_session_count(len(self.list(owner)) + num_new - 1)

    def end_turn(self, session: Session, num_tokens: int | None, block_hashes: list[str] | None,
                 cached_tokens: int = 0) -> None:
        """A turn ended: record what the session holds now (when known) and slide its expiry."""
        session.busy = False
        self._turns += 1
        self._hit_tokens += cached_tokens
        if num_tokens is not None:
            before = session.block_hashes
            session.record_turn(num_tokens, block_hashes or [])
            self._recount(session, before)
        session.expires = self.clock() + session.ttl_s
        if self.store.held(session.owner, session.session_id) is not None:
            self.store.save(session)

    def refresh_pin(self, pin: Session, num_tokens: int, block_hashes: list[str], ttl_s: int) -> None:
        """A read or a write of a prompt-cache pin: it holds these blocks, is no longer busy, and
        expires no sooner than ``ttl_s`` from now (a later expiry it had stays, with its TTL). SessionNotDurable
        when its record cannot be written (the record here holds the new state all the same)."""
        pin.busy = False
        pin.num_tokens = num_tokens
        self._set_blocks(pin, block_hashes)
        expires = self.clock() + ttl_s
        if expires > pin.expires:
            pin.ttl_s, pin.expires = ttl_s, expires
        if self.store.held(pin.owner, pin.session_id) is not None:
            self.store.save(pin)

    def set_ttl(self, session: Session, ttl_s: int) -> None:
        """New TTL; the session now expires ttl_s from now."""
        before = session.ttl_s, session.expires
        session.ttl_s = ttl_s
        session.expires = self.clock() + ttl_s
        try:
            self.store.save(session)
        except SessionNotDurable:
            session.ttl_s, session.expires = before
            raise

    def delete(self, session: Session) -> None:
        """Forget the session, here and in the backend (the caller frees its blocks in the engine)."""
        session.busy = False
        if self._remove(session):
            self._deleted += 1
        self.store.delete_record(session)

    def evict(self, session: Session) -> None:
        """Forget an idle conversation to make room for a new one (``idle_conversation_to_evict``);
        the caller releases its blocks, which the prefix cache keeps while there is room."""
        if self._remove(session):
            self._evicted += 1
        self.store.delete_record(session)

    def pop_expired(self) -> list[Session]:
        """Remove and return every expired, idle session or pin (the caller frees their blocks).

        A local backend's records go too; a shared backend's expire in Redis on their own (and a
        record another replica extended since must stay)."""
        expired = self.store.pop_expired()          # ``Session.can_sweep``: pins whose request never ended too
        for session in expired:
            self._count_blocks(session, session.block_hashes, -1)
        self._expired += len(expired)
        return expired

    # ------------------------------------------------------------------ holdings

    def _add(self, session: Session) -> None:
        self.store.hold(session)
        self._count_blocks(session, session.block_hashes, 1)

    def _remove(self, session: Session) -> bool:
        if not self.store.release(session):
            return False
        self._count_blocks(session, session.block_hashes, -1)
        return True

    def _count_blocks(self, session: Session, block_hashes: list[str], delta: int) -> None:
        """Count a held session's blocks in the keeper tier's rule, unless it keeps them in memory only."""
        if not session.in_memory:
            self.limits.count_blocks(block_hashes, delta)

    def _set_blocks(self, session: Session, block_hashes: list[str]) -> None:
        before, session.block_hashes = session.block_hashes, block_hashes
        self._recount(session, before)

    def _recount(self, session: Session, before: list[str]) -> None:
        """The session's blocks changed from ``before``: count them again if it is held here."""
        if self.store.holds(session):
            self._count_blocks(session, before, -1)
            self._count_blocks(session, session.block_hashes, 1)

    # ------------------------------------------------------------------ persistence

    def _apply(self, held: Session | None, read: BackendRead) -> Session | None:
        """The session as the shared backend has it now, held here (pinned via ``on_load``).

        ``read.lost``: the backend could not be read, or lost the record: keep what is held here."""
        if held is not None and held.busy:
            return held                           # a turn began while the read ran: it wins
        if read.lost:
            self.republish_if_wanted()
            return held
        current = self.store.parse(read.record)
        if current is None or current.expires <= self.clock():
            if held is not None:
                held.expires = min(held.expires, self.clock())   # ended elsewhere: the sweep frees it
            return held
        if held is None:
            self._add(current)
            self._pin(current)
            return current
        held.ttl_s, held.expires, held.num_tokens = current.ttl_s, current.expires, current.num_tokens
        held.num_turns, held.turn_ends = current.num_turns, current.turn_ends
        if held.block_hashes != current.block_hashes:      # another replica ran turns since
            self._set_blocks(held, current.block_hashes)
            self._pin(held)
        return held

    def republish_if_wanted(self) -> int:
        """Write every live session held here again, if the backend may lack them; how many."""
        return self.store.republish_if_wanted()

    async def check_backend(self) -> None:
        """Ask a shared backend whether it lost its data (off the event loop); republish if so."""
        await self.store.check_backend()

    def _pin(self, session: Session) -> None:
        if self.on_load is not None:
            self.on_load(session)
