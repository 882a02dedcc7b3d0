"""The session registry: ids, owners, TTLs and sliding expiry, limits, and persistence (torch-free).

A session (a ``/v1/context`` cache or a chat ``conversation_id``) is one record here plus the
blocks the engine holds for it under ``Session.engine_id`` (see ``kvhive.kv.manager``). The
registry lives on the server's event loop; the engine is told only to free a session's blocks.

Rules, in one place:

- Sessions are keyed by (owner, id): another API key's session is not found (404), and a
  ``conversation_id`` that another key also uses names a different session.
- Expiry is sliding: each finished turn sets ``expires = now + ttl``; TTLs are whole seconds in
  (0, max_ttl]. A session busy with a turn never expires under it.
- One turn at a time: a second request on a busy session is refused (409), nothing changes.
- Persistence: every change rewrites one small JSON document atomically (a temp file and
  ``os.replace`` in the disk cache dir, or one Redis key), so sessions and expiries survive a kill.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhive.config import SessionConfig

logger = logging.getLogger(__name__)

SESSIONS_FILE = "sessions.json"
_FORMAT_VERSION = 1


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
    """A request about a session that cannot be served; carries its HTTP status and OpenAI code."""

    def __init__(self, status_code: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


def not_found(session_id: str) -> SessionError:
    """404 for an id that is unknown, expired, deleted or another key's."""
    return SessionError(404, f"Session '{session_id}' does not exist (unknown, expired or deleted)",
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


class FileBackend:
    """Persists the registry as one JSON file, replaced atomically (write temp, fsync, rename)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, SESSIONS_FILE)

    def load(self) -> bytes | None:
        """The last saved document, or None."""
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def save(self, data: bytes) -> None:
        """Replace the document; a kill at any point leaves the old or the new one."""
        tmp = f"{self.path}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class RedisBackend:
    """Persists the registry as one Redis string (shared by replicas with the same key name)."""

    def __init__(self, url: str, key: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2.0)
        self.key = key

    def load(self) -> bytes | None:
        """The last saved document, or None."""
        return self.client.get(self.key)

    def save(self, data: bytes) -> None:
        """Replace the document (one SET, atomic)."""
        self.client.set(self.key, data)


def format_bytes(num_bytes: float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1, e.g. ``52.4 KiB``."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def parse_ttl(value: object, max_ttl_s: int, param: str = "x-session-ttl") -> int:
    """A TTL in whole seconds in (0, max_ttl_s], from a header string or a JSON number; 400 otherwise."""
    if value is None or value == "":
        raise SessionError(400, f"'{param}' is required: the session's time to live in seconds",
                           "missing_session_ttl", param)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SessionError(400, f"'{param}' must be a whole number of seconds, got {value!r}",
                           "invalid_session_ttl", param)
    try:
        ttl = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        raise SessionError(400, f"'{param}' must be a whole number of seconds, got {value!r}",
                           "invalid_session_ttl", param) from None
    if ttl <= 0:
        raise SessionError(400, f"'{param}' must be positive, got {ttl}", "invalid_session_ttl", param)
    if ttl > max_ttl_s:
        raise SessionError(400, f"'{param}' is {ttl}s; this server allows at most {max_ttl_s}s "
                                f"(--max-session-ttl)", "session_ttl_too_long", param)
    return ttl


class SessionRegistry:
    """Session records by (owner, id), with sliding expiry, per-key limits and persistence."""

    def __init__(self, config: SessionConfig, bytes_per_token: float,
                 backend: FileBackend | RedisBackend | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.bytes_per_token = bytes_per_token
        self.backend = backend
        self.clock = clock
        self._sessions: dict[tuple[str | None, str], Session] = {}
        self._turns = self._hit_tokens = self._expired = self._deleted = 0
        if backend is not None:
            self._load()

    # ------------------------------------------------------------------ lookups

    def get(self, session_id: str, owner: str | None) -> Session:
        """The caller's live session; SessionError 404 if unknown, expired, deleted or another key's."""
        session = self._sessions.get((owner, session_id))
        if session is None or (not session.busy and session.expires <= self.clock()):
            raise not_found(session_id)
        return session

    def list(self, owner: str | None) -> list[Session]:
        """The caller's live sessions, oldest first."""
        now = self.clock()
        return sorted((s for (o, _), s in self._sessions.items() if o == owner and (s.busy or s.expires > now)),
                      key=lambda s: s.created)

    def live_sessions(self) -> list[Session]:
        """Every owner's live sessions (to pin their blocks again after a restart)."""
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

    # ------------------------------------------------------------------ changes

    def create(self, owner: str | None, model: str, ttl_s: int, session_id: str | None = None) -> Session:
        """A new busy session (its first turn is about to run); 429 over the per-key count limit."""
        limit = self.config.max_sessions_per_key
        if limit is not None and len(self.list(owner)) >= limit:
            raise SessionError(429, f"This API key already has {limit} live sessions "
                                    f"(--max-sessions-per-key); delete one or let one expire",
                               "too_many_sessions")
        now = self.clock()
        session = Session(session_id or f"sess-{uuid.uuid4().hex}", owner, model, ttl_s, now, now + ttl_s,
                          busy=True, turn=1)
        self._sessions[(owner, session.session_id)] = session
        self._persist()
        return session

    def begin_turn(self, session: Session, model: str, new_tokens: int) -> None:
        """Mark the session busy for one turn: 400 for another model, 409 if busy, 429 over bytes."""
        if session.model != model:
            raise SessionError(400, f"Session '{session.session_id}' holds KV of model "
                                    f"'{session.model}', not '{model}'", "session_model_mismatch", "model")
        if session.busy:
            raise SessionError(409, f"Session '{session.session_id}' is busy with another request; "
                                    f"send one request at a time per session", "session_busy")
        self.check_pinned(session.owner, new_tokens, exclude=session)
        session.busy = True
        session.turn += 1

    def check_pinned(self, owner: str | None, num_tokens: int, exclude: Session | None = None) -> None:
        """429 when the owner's sessions would hold more than --max-pinned-gb with num_tokens more."""
        if self.config.max_pinned_gb is None:
            return
        limit = self.config.max_pinned_gb * 2**30
        held_tokens = sum(s.num_tokens for (o, _), s in self._sessions.items() if o == owner and s is not exclude)
        wanted_tokens = held_tokens + num_tokens
        wanted = wanted_tokens * self.bytes_per_token
        if wanted > limit:
            raise SessionError(429, f"This API key's sessions would hold {wanted_tokens} tokens "
                                    f"({format_bytes(wanted)}) of KV, over its limit of {format_bytes(limit)} "
                                    f"(--max-pinned-gb {self.config.max_pinned_gb:g}): {held_tokens} tokens held "
                                    f"by its sessions, {num_tokens} for this request (prompt + max_tokens). "
                                    f"Delete a session, let one expire, or send a shorter request",
                               "session_kv_limit")

    def end_turn(self, session: Session, num_tokens: int | None, block_hashes: list[str] | None,
                 cached_tokens: int = 0) -> None:
        """A turn ended: record what the session holds now (when known) and slide its expiry."""
        session.busy = False
        self._turns += 1
        self._hit_tokens += cached_tokens
        if num_tokens is not None:
            session.num_tokens = num_tokens
            session.block_hashes = block_hashes or []
        session.expires = self.clock() + session.ttl_s
        self._persist()

    def set_ttl(self, session: Session, ttl_s: int) -> None:
        """New TTL; the session now expires ttl_s from now."""
        session.ttl_s = ttl_s
        session.expires = self.clock() + ttl_s
        self._persist()

    def delete(self, session: Session) -> None:
        """Forget the session (the caller frees its blocks in the engine)."""
        session.busy = False
        if self._sessions.pop((session.owner, session.session_id), None) is not None:
            self._deleted += 1
        self._persist()

    def pop_expired(self) -> list[Session]:
        """Remove and return every expired, idle session (the caller frees their blocks)."""
        now = self.clock()
        expired = [s for s in self._sessions.values() if not s.busy and s.expires <= now]
        for session in expired:
            del self._sessions[(session.owner, session.session_id)]
        self._expired += len(expired)
        if expired:
            self._persist()
        return expired

    # ------------------------------------------------------------------ persistence

    def _persist(self) -> None:
        if self.backend is None:
            return
        doc = {"version": _FORMAT_VERSION, "sessions": [s.to_json() for s in self._sessions.values()]}
        try:
            self.backend.save(json.dumps(doc).encode())
        except Exception:  # noqa: BLE001 - a failed save must not fail the request; the next retries
            logger.exception("could not persist the session registry")

    def _load(self) -> None:
        try:
            raw = self.backend.load()
            if raw is None:
                return
            doc = json.loads(raw)
            if doc.get("version") != _FORMAT_VERSION:
                logger.warning("ignoring session registry of version %r", doc.get("version"))
                return
            for d in doc["sessions"]:
                session = Session.from_json(d)
                self._sessions[(session.owner, session.session_id)] = session
        except Exception:  # noqa: BLE001 - a corrupt registry starts empty rather than not at all
            logger.exception("could not load the session registry; starting with none")
