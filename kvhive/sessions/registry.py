"""The session registry: ids, owners, TTLs and sliding expiry, limits, and persistence (torch-free).

A session (a ``/v1/context`` cache or a chat ``conversation_id``) is one record here plus the
blocks the engine holds for it under ``Session.engine_id`` (see ``kvhive.kv.manager``). The
registry lives on the server's event loop; the engine is told only to pin and free a session's
blocks (``on_load`` pins the blocks of a session taken from the backend).

Rules, in one place:

- Sessions are keyed by (owner, id): another API key's session is not found, and a
  ``conversation_id`` that another key also uses names a different session.
- Expiry is sliding: each finished turn sets ``expires = now + ttl``; TTLs are whole seconds in
  (0, max_ttl]. A session busy with a turn never expires under it.
- One turn at a time: a second request on a busy session is refused (busy), nothing changes.
- Limits: per key (``--max-sessions-per-key``, ``--max-pinned-gb``) and server-wide (the blocks of
  all sessions must fit in the keeper tier that pins them, less ``KEEPER_MARGIN``); a request over
  one is refused (a limit) before anything changes.
- Persistence (``kvhive.sessions.backends``): every change writes that session's record. A local
  backend (disk dir) is loaded whole at start. A shared one (Redis) is the truth for every
  replica: a session this replica does not hold is loaded on first use, and one it holds is read
  again on each use (another replica may have extended, re-TTL'd or deleted it since).
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

import asyncio
import logging
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhive.config import SessionConfig
from kvhive.sessions.backends import SessionBackend
from kvhive.store.redis_guard import RedisUnavailable, backend_lost_data, check_backend_data

logger = logging.getLogger(__name__)

# Session ids a client names (``conversation_id``, ``x-session-id``): 1 to MAX_SESSION_ID_CHARS of
# these ASCII characters, safe in a header, a Redis key and a file name.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.:-]+$"
MAX_SESSION_ID_CHARS = 128

# The share of the keeper tier's budget kept free of session pins: room for block headers, for the
# disk tier's partly filled segments, and for the blocks other requests pass through the tier.
KEEPER_MARGIN = 0.10


@dataclass(frozen=True)
class KeeperTier:
    """The store tier that keeps pinned session blocks (the lowest one with a byte budget)."""

    name: str              # "cpu" or "disk"
    budget_bytes: int
    option: str            # the flag that sets the budget, for messages: "--cpu-offload-gb 2"

    @property
    def session_budget_bytes(self) -> int:
        """What all sessions together may pin in it."""
        return int(self.budget_bytes * (1 - KEEPER_MARGIN))


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


class SessionError(Exception):
    """A request about a session (or a stored response) that cannot be served: its kind is the
    subclass; ``code`` and ``param`` name the reason and the field (the server maps kinds to statuses)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class SessionInvalid(SessionError):
    """The request names a session wrongly: a malformed id or TTL, another model's session."""


class SessionNotFound(SessionError):
    """No such live session (or stored response) for this caller: unknown, expired, deleted or another key's."""


class SessionBusy(SessionError):
    """The session is running another turn; nothing changed."""


class SessionLimit(SessionError):
    """A limit (sessions per key, KV per key, the keeper tier, responses per conversation) refuses it."""


def not_found(session_id: str) -> SessionNotFound:
    """An id that is unknown, expired, deleted or another key's."""
    return SessionNotFound(f"Session '{session_id}' does not exist (unknown, expired or deleted)",
                           "session_not_found", "x-session-id")


@dataclass
class Session:
    """One session's record; its KV blocks live in the engine under ``engine_id``."""

    session_id: str
    owner: str | None              # digest of the creating API key; None without API keys
    model: str
    ttl_s: int
    created: float                 # unix time
    expires: float                 # unix time; now + ttl after each turn
    num_tokens: int = 0            # tokens the session holds (prompt + output of its last turn)
    block_hashes: list[str] = field(default_factory=list)    # hex, full blocks of those tokens
    busy: bool = False             # a turn is running (not persisted)
    turn: int = 0                  # turns begun since load (not persisted): tells one turn's end from a later one's

    @property
    def engine_id(self) -> str:
        """The id the engine holds the blocks under (unique across owners)."""
        return f"{self.owner or '-'}/{self.session_id}"

    def to_json(self) -> dict:
        """The persisted fields."""
        return {"id": self.session_id, "owner": self.owner, "model": self.model, "ttl": self.ttl_s,
                "created": self.created, "expires": self.expires, "num_tokens": self.num_tokens,
                "block_hashes": self.block_hashes}

    @classmethod
    def from_json(cls, d: dict) -> Session:
        """Inverse of ``to_json``."""
        return cls(d["id"], d["owner"], d["model"], int(d["ttl"]), float(d["created"]),
                   float(d["expires"]), int(d["num_tokens"]), list(d["block_hashes"]))


def check_session_id(session_id: str, param: str) -> None:
    """SessionInvalid unless ``session_id`` matches SESSION_ID_PATTERN within MAX_SESSION_ID_CHARS."""
    if len(session_id) > MAX_SESSION_ID_CHARS or re.fullmatch(SESSION_ID_PATTERN, session_id) is None:
        raise SessionInvalid(f"'{param}' must be 1 to {MAX_SESSION_ID_CHARS} characters of A-Z, a-z, "
                             f"0-9, '_', '.', ':' and '-', got {session_id[:40]!r}", "invalid_session_id", param)


def format_bytes(num_bytes: float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1, e.g. ``52.4 KiB``."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def parse_ttl(value: object, max_ttl_s: int, param: str = "x-session-ttl") -> int:
    """A TTL in whole seconds in (0, max_ttl_s], from a header string or a JSON number; SessionInvalid otherwise."""
    if value is None or value == "":
        raise SessionInvalid(f"'{param}' is required: the session's time to live in seconds",
                             "missing_session_ttl", param)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SessionInvalid(f"'{param}' must be a whole number of seconds, got {value!r}",
                             "invalid_session_ttl", param)
    try:
        ttl = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        raise SessionInvalid(f"'{param}' must be a whole number of seconds, got {value!r}",
                             "invalid_session_ttl", param) from None
    if ttl <= 0:
        raise SessionInvalid(f"'{param}' must be positive, got {ttl}", "invalid_session_ttl", param)
    if ttl > max_ttl_s:
        raise SessionInvalid(f"'{param}' is {ttl}s; this server allows at most {max_ttl_s}s "
                             f"(--max-session-ttl)", "session_ttl_too_long", param)
    return ttl


class SessionRegistry:
    """Session records by (owner, id), with sliding expiry, limits and persistence."""

    def __init__(self, config: SessionConfig, block_bytes: int, block_size: int,
                 backend: SessionBackend | None = None, keeper: KeeperTier | None = None,
                 on_load: Callable[[Session], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.bytes_per_token = block_bytes / block_size
        self.backend = backend
        self.keeper = keeper
        self.on_load = on_load
        self.clock = clock
        self._sessions: dict[tuple[str | None, str], Session] = {}
        # Invariant: _block_refs[h] == number of sessions in _sessions whose block_hashes hold h (> 0).
        self._block_refs: Counter[str] = Counter()
        self._turns = self._hit_tokens = self._expired = self._deleted = 0
        # Set from any thread when the shared backend may lack what is held here; cleared by the
        # republish (on the registry's own thread).
        self._republish_wanted = False
        self._losses = 0            # times told the backend may lack what is held here (any thread)
        if backend is not None:
            add_listener = getattr(backend, "add_listener", None)
            if add_listener is not None:
                add_listener(self.want_republish)
            self._load_all()

    # ------------------------------------------------------------------ lookups

    def get(self, session_id: str, owner: str | None) -> Session:
        """The caller's live session; SessionNotFound if unknown, expired, deleted or another key's.

        With a shared backend, an idle session is read from it again (and one this replica does
        not hold yet is loaded and pinned); this blocks on the backend (the server calls ``aget``)."""
        session = self._sessions.get((owner, session_id))
        if self._rereads(session):
            losses = self._losses
            self.republish_if_wanted()
            record, lost = self._read(owner, session_id, session, losses)
            session = self._apply(owner, session_id, session, record, lost)
        return self._live(session, session_id)

    async def aget(self, session_id: str, owner: str | None) -> Session:
        """``get`` with the backend read on a worker thread, off the event loop."""
        session = self._sessions.get((owner, session_id))
        if self._rereads(session):
            losses = self._losses
            self.republish_if_wanted()
            record, lost = await asyncio.to_thread(self._read, owner, session_id, session, losses)
            session = self._apply(owner, session_id, self._sessions.get((owner, session_id)), record, lost)
        return self._live(session, session_id)

    def _rereads(self, session: Session | None) -> bool:
        """Whether a lookup reads the backend again: shared, and the session not busy here."""
        return self.backend is not None and self.backend.shared and (session is None or not session.busy)

    def _live(self, session: Session | None, session_id: str) -> Session:
        if session is None or (not session.busy and session.expires <= self.clock()):
            raise not_found(session_id)
        return session

    def list(self, owner: str | None) -> list[Session]:
        """The caller's live sessions on this replica, oldest first."""
        now = self.clock()
        return sorted((s for (o, _), s in self._sessions.items() if o == owner and (s.busy or s.expires > now)),
                      key=lambda s: s.created)

    def live_sessions(self) -> list[Session]:
        """Every owner's live sessions."""
        now = self.clock()
        return [s for s in self._sessions.values() if s.busy or s.expires > now]

    def stats(self) -> SessionStats:
        """Live sessions, what they hold, and the cumulative counters."""
        live = self.live_sessions()
        return SessionStats(len(live), sum(s.num_tokens for s in live), sum(len(s.block_hashes) for s in live),
                            self._turns, self._hit_tokens, self._expired, self._deleted)

    def pinned_bytes(self, owner: str | None) -> int:
        """KV bytes the owner's sessions hold."""
        return int(sum(s.num_tokens for (o, _), s in self._sessions.items() if o == owner)
                   * self.bytes_per_token)

    def pinned_block_bytes(self, exclude: Session | None = None) -> int:
        """Bytes of the distinct full blocks all sessions pin (less those only ``exclude`` pins)."""
        num_blocks = len(self._block_refs)
        if exclude is not None:
            num_blocks -= sum(1 for h in set(exclude.block_hashes) if self._block_refs[h] == 1)
        return num_blocks * self.block_bytes

    # ------------------------------------------------------------------ changes

    def create(self, owner: str | None, model: str, ttl_s: int, session_id: str | None = None) -> Session:
        """A new busy session (its first turn is about to run); SessionLimit over the per-key count limit."""
        limit = self.config.max_sessions_per_key
        if limit is not None and len(self.list(owner)) >= limit:
            raise SessionLimit(f"This API key already has {limit} live sessions "
                               f"(--max-sessions-per-key); delete one or let one expire",
                               "too_many_sessions")
        now = self.clock()
        session = Session(session_id or f"sess-{uuid.uuid4().hex}", owner, model, ttl_s, now, now + ttl_s,
                          busy=True, turn=1)
        self._add(session)
        self._save(session)
        return session

    def begin_turn(self, session: Session, model: str, new_tokens: int) -> None:
        """Mark the session busy for one turn: SessionInvalid for another model, SessionBusy if busy,
        SessionLimit over bytes."""
        if session.model != model:
            raise SessionInvalid(f"Session '{session.session_id}' holds KV of model "
                                 f"'{session.model}', not '{model}'", "session_model_mismatch", "model")
        if session.busy:
            raise SessionBusy(f"Session '{session.session_id}' is busy with another request; "
                              f"send one request at a time per session", "session_busy")
        self.check_pinned(session.owner, new_tokens, exclude=session)
        session.busy = True
        session.turn += 1

    def check_pinned(self, owner: str | None, num_tokens: int, exclude: Session | None = None) -> None:
        """SessionLimit when a session holding ``num_tokens`` (prompt + max_tokens) in place of ``exclude``
        would take the owner's sessions over --max-pinned-gb, or all sessions over the keeper tier."""
        self._check_key_limit(owner, num_tokens, exclude)
        self._check_keeper(num_tokens, exclude)

    def _check_key_limit(self, owner: str | None, num_tokens: int, exclude: Session | None) -> None:
        if self.config.max_pinned_gb is None:
            return
        limit = self.config.max_pinned_gb * 2**30
        held_tokens = sum(s.num_tokens for (o, _), s in self._sessions.items() if o == owner and s is not exclude)
        wanted_tokens = held_tokens + num_tokens
        wanted = wanted_tokens * self.bytes_per_token
        if wanted > limit:
            raise SessionLimit(f"This API key's sessions would hold {wanted_tokens} tokens "
                               f"({format_bytes(wanted)}) of KV, over its limit of {format_bytes(limit)} "
                               f"(--max-pinned-gb {self.config.max_pinned_gb:g}): {held_tokens} tokens held "
                               f"by its sessions, {num_tokens} for this request (prompt + max_tokens). "
                               f"Delete a session, let one expire, or send a shorter request",
                               "session_kv_limit")

    def _check_keeper(self, num_tokens: int, exclude: Session | None) -> None:
        # The scheduler moves an idle session off the device only once the keeper holds its blocks:
        # sessions pinning more than the keeper can hold would leave new requests waiting forever.
        if self.keeper is None:
            return
        held = self.pinned_block_bytes(exclude)
        new = num_tokens // self.block_size * self.block_bytes      # full blocks are what gets pinned
        budget = self.keeper.session_budget_bytes
        if held + new > budget:
            raise SessionLimit(f"The server's sessions would pin {format_bytes(held + new)} of KV in its "
                               f"{self.keeper.name} tier, over the {format_bytes(budget)} it keeps for "
                               f"sessions ({1 - KEEPER_MARGIN:.0%} of {self.keeper.option}): "
                               f"{format_bytes(held)} pinned by live sessions, {format_bytes(new)} for this "
                               f"request (prompt + max_tokens). Retry when sessions have ended or expired, "
                               f"or send a shorter request", "session_tier_full")

    def end_turn(self, session: Session, num_tokens: int | None, block_hashes: list[str] | None,
                 cached_tokens: int = 0) -> None:
        """A turn ended: record what the session holds now (when known) and slide its expiry."""
        session.busy = False
        self._turns += 1
        self._hit_tokens += cached_tokens
        if num_tokens is not None:
            session.num_tokens = num_tokens
            self._set_blocks(session, block_hashes or [])
        session.expires = self.clock() + session.ttl_s
        if (session.owner, session.session_id) in self._sessions:
            self._save(session)

    def set_ttl(self, session: Session, ttl_s: int) -> None:
        """New TTL; the session now expires ttl_s from now."""
        session.ttl_s = ttl_s
        session.expires = self.clock() + ttl_s
        self._save(session)

    def delete(self, session: Session) -> None:
        """Forget the session, here and in the backend (the caller frees its blocks in the engine)."""
        session.busy = False
        if self._remove(session):
            self._deleted += 1
        if self.backend is not None:
            try:
                self.backend.delete(session.owner, session.session_id)
            except Exception:  # noqa: BLE001 - the session is gone here; a shared record expires on its own
                logger.exception("could not delete the record of session %s", session.session_id)

    def pop_expired(self) -> list[Session]:
        """Remove and return every expired, idle session (the caller frees their blocks).

        A local backend's records go too; a shared backend's expire in Redis on their own (and a
        record another replica extended since must stay)."""
        now = self.clock()
        expired = [s for s in self._sessions.values() if not s.busy and s.expires <= now]
        for session in expired:
            self._remove(session)
            if self.backend is not None and not self.backend.shared:
                try:
                    self.backend.delete(session.owner, session.session_id)
                except OSError:
                    logger.exception("could not delete the record of session %s", session.session_id)
        self._expired += len(expired)
        return expired

    # ------------------------------------------------------------------ holdings

    def _add(self, session: Session) -> None:
        self._sessions[(session.owner, session.session_id)] = session
        self._count_blocks(session.block_hashes, 1)

    def _remove(self, session: Session) -> bool:
        if self._sessions.get((session.owner, session.session_id)) is not session:
            return False
        del self._sessions[(session.owner, session.session_id)]
        self._count_blocks(session.block_hashes, -1)
        return True

    def _set_blocks(self, session: Session, block_hashes: list[str]) -> None:
        held = self._sessions.get((session.owner, session.session_id)) is session
        if held:
            self._count_blocks(session.block_hashes, -1)
        session.block_hashes = block_hashes
        if held:
            self._count_blocks(block_hashes, 1)

    def _count_blocks(self, block_hashes: list[str], delta: int) -> None:
        for h in set(block_hashes):
            count = self._block_refs[h] + delta
            if count > 0:
                self._block_refs[h] = count
            else:
                del self._block_refs[h]

    # ------------------------------------------------------------------ persistence

    def _save(self, session: Session) -> None:
        if self.backend is None:
            return
        try:
            self.backend.save(session.to_json())
        except Exception:  # noqa: BLE001 - a failed save must not fail the request; the next one retries
            logger.exception("could not persist session %s", session.session_id)

    @staticmethod
    def _parse(record: dict | None) -> Session | None:
        """A record as an idle session; None for no record or a corrupt one."""
        if record is None:
            return None
        try:
            return Session.from_json(record)
        except (KeyError, TypeError, ValueError):
            logger.exception("ignoring a corrupt session record")
            return None

    def _read(self, owner: str | None, session_id: str, held: Session | None,
              losses: int) -> tuple[dict | None, bool]:
        """The backend's record (None: none, or unreadable) and whether Redis lost it: for a
        session held here and missing there, whether the backend lost its data, by its marker or
        by a loss noted since ``losses`` (another check found it first and republishes); then the
        session is republished, not ended. Blocking: any thread."""
        assert self.backend is not None
        try:
            record = self.backend.load(owner, session_id)
        except Exception as exc:  # noqa: BLE001 - backend down: what this replica holds is the best it knows
            # Quiet while Redis is unreachable: its breaker has logged that once.
            logger.log(logging.DEBUG if isinstance(exc, RedisUnavailable) else logging.WARNING,
                       "could not read session %s from the session backend (%s: %s)",
                       session_id, type(exc).__name__, exc)
            return None, True
        if record is not None or held is None:
            return record, False
        return None, backend_lost_data(self.backend) or self._losses != losses

    def _apply(self, owner: str | None, session_id: str, held: Session | None, record: dict | None,
               lost: bool) -> Session | None:
        """The session as the shared backend has it now, held here (pinned via ``on_load``).

        ``lost``: the backend could not be read, or lost the record: keep what is held here."""
        if held is not None and held.busy:
            return held                           # a turn began while the read ran: it wins
        if lost:
            self.republish_if_wanted()
            return held
        current = self._parse(record)
        if current is None or current.expires <= self.clock():
            if held is not None:
                held.expires = min(held.expires, self.clock())   # ended elsewhere: the sweep frees it
            return held
        if held is None:
            self._add(current)
            self._pin(current)
            return current
        held.ttl_s, held.expires, held.num_tokens = current.ttl_s, current.expires, current.num_tokens
        if held.block_hashes != current.block_hashes:      # another replica ran turns since
            self._set_blocks(held, current.block_hashes)
            self._pin(held)
        return held

    def want_republish(self) -> None:
        """The shared backend may lack what this replica holds: republish before its next read.
        Safe from any thread (it only sets a flag and counts)."""
        self._losses += 1
        self._republish_wanted = True

    def republish_if_wanted(self) -> int:
        """Write every live session held here again, if the backend may lack them; how many."""
        if not self._republish_wanted:
            return 0
        self._republish_wanted = False
        live = self.live_sessions()
        for session in live:
            self._save(session)
        if live:
            logger.info("republished %d sessions to the session backend", len(live))
        return len(live)

    async def check_backend(self) -> None:
        """Ask a shared backend whether it lost its data (off the event loop); republish if so."""
        if self._sessions and await check_backend_data(self.backend):
            self.republish_if_wanted()

    def _pin(self, session: Session) -> None:
        if self.on_load is not None:
            self.on_load(session)

    def _load_all(self) -> None:
        """Hold the backend's sessions (a local backend's all, expired ones for the sweep to drop;
        a shared one's load on use) and pin the live ones."""
        assert self.backend is not None
        try:
            records = self.backend.load_all()
        except Exception:  # noqa: BLE001 - an unreadable registry starts empty rather than not at all
            logger.exception("could not load the session registry; starting with none")
            return
        now = self.clock()
        for record in records:
            session = self._parse(record)
            if session is not None:
                self._add(session)
                if session.expires > now:
                    self._pin(session)
