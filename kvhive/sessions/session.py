"""A session's record, and the checks of the fields a client names a session by (its id, its TTL).

A session (a ``/v1/context`` cache or a chat ``conversation_id``) is one ``Session`` record plus
the blocks the engine holds for it under ``Session.engine_id``; ``to_json`` is what a backend stores.
A prompt-cache pin (``kvhive.sessions.prefix_pins``) is a record of kind ``PIN_KIND``: listed,
counted, persisted and expired like any session, but never run in (its id holds a character a
client's session id may not, so no request can name it as its session).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvhive.sessions.errors import SessionInvalid

# Session ids a client names (``conversation_id``, ``x-session-id``): 1 to MAX_SESSION_ID_CHARS of
# these ASCII characters, safe in a header, a Redis key and a file name.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_.:-]+$"
MAX_SESSION_ID_CHARS = 128
# A record's kind: a session requests run in, or a prompt-cache pin (``kvhive.sessions.prefix_pins``).
SESSION_KIND = "session"
PIN_KIND = "pin"


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
    kind: str = SESSION_KIND       # SESSION_KIND, or PIN_KIND for a prompt-cache pin
    # Held in this process only: its record is never written and no store tier keeps its blocks.
    in_memory: bool = False

    @property
    def is_pin(self) -> bool:
        """Whether this record is a prompt-cache pin rather than a session requests run in."""
        return self.kind == PIN_KIND

    @property
    def engine_id(self) -> str:
        """The id the engine holds the blocks under (unique across owners)."""
        return f"{self.owner or '-'}/{self.session_id}"

    def to_json(self) -> dict:
        """The persisted fields."""
        return {"id": self.session_id, "owner": self.owner, "model": self.model, "ttl": self.ttl_s,
                "created": self.created, "expires": self.expires, "num_tokens": self.num_tokens,
                "block_hashes": self.block_hashes, "kind": self.kind}

    @classmethod
    def from_json(cls, d: dict) -> Session:
        """Inverse of ``to_json`` (a record written before kinds existed is a session)."""
        kind = d.get("kind", SESSION_KIND)
        if kind not in (SESSION_KIND, PIN_KIND):
            raise ValueError(f"unknown session record kind {kind!r}")
        return cls(d["id"], d["owner"], d["model"], int(d["ttl"]), float(d["created"]),
                   float(d["expires"]), int(d["num_tokens"]), list(d["block_hashes"]), kind=kind)


def check_session_id(session_id: str, param: str) -> None:
    """SessionInvalid unless ``session_id`` matches SESSION_ID_PATTERN within MAX_SESSION_ID_CHARS."""
    if len(session_id) > MAX_SESSION_ID_CHARS or re.fullmatch(SESSION_ID_PATTERN, session_id) is None:
        raise SessionInvalid(f"'{param}' must be 1 to {MAX_SESSION_ID_CHARS} characters of A-Z, a-z, "
                             f"0-9, '_', '.', ':' and '-', got {session_id[:40]!r}", "invalid_session_id", param)


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

