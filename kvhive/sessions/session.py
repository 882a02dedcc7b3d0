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
# Turn boundaries a record keeps (the latest ones): a fork names one (``Session.tokens_after``).
MAX_TURN_ENDS = 256


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
    num_turns: int = 0             # turns finished that recorded what the session holds (persisted)
    turn_ends: list[int] = field(default_factory=list)   # num_tokens after each of the latest MAX_TURN_ENDS of them
    conversation: bool = False     # made by a conversation_id (``--max-active-conversations`` counts these)
    kind: str = SESSION_KIND       # SESSION_KIND, or PIN_KIND for a prompt-cache pin
    # Held in this process only: its record is never written and no store tier keeps its blocks.
    in_memory: bool = False

    @property
    def is_pin(self) -> bool:
        """Whether this record is a prompt-cache pin rather than a session requests run in."""
        return self.kind == PIN_KIND

    @property
    def record_id(self) -> str:
        """Its id in the record store (``kvhive.sessions.expiring``)."""
        return self.session_id

    @property
    def written(self) -> bool:
        """Whether its record is written to the backend (never for one held in memory only)."""
        return not self.in_memory

    def is_live(self, now: float) -> bool:
        """Not expired at ``now``; a session busy with a turn never expires under it."""
        return self.busy or self.expires > now

    def can_sweep(self, now: float) -> bool:
        """Whether the expiry sweep drops it at ``now``: expired and idle. A pin is busy only until
        the request that creates it has computed its prompt; one whose request never ended expires
        all the same (a session's turn always ends)."""
        return (not self.busy or self.is_pin) and self.expires <= now

    @property
    def engine_id(self) -> str:
        """The id the engine holds the blocks under (unique across owners)."""
        return f"{self.owner or '-'}/{self.session_id}"

    def to_json(self) -> dict:
        """The persisted fields."""
        return {"id": self.session_id, "owner": self.owner, "model": self.model, "ttl": self.ttl_s,
                "created": self.created, "expires": self.expires, "num_tokens": self.num_tokens,
                "block_hashes": self.block_hashes, "kind": self.kind, "num_turns": self.num_turns,
                "turn_ends": self.turn_ends, "conversation": self.conversation}

    @classmethod
    def from_json(cls, d: dict) -> Session:
        """Inverse of ``to_json``. A record written before kinds existed is a session; one written
        before turns were counted reads as one turn holding its tokens (none when it holds none)."""
        kind = d.get("kind", SESSION_KIND)
        if kind not in (SESSION_KIND, PIN_KIND):
            raise ValueError(f"unknown session record kind {kind!r}")
        session = cls(d["id"], d["owner"], d["model"], int(d["ttl"]), float(d["created"]),
                      float(d["expires"]), int(d["num_tokens"]), list(d["block_hashes"]), kind=kind)
        if "num_turns" in d:
            session.num_turns = int(d["num_turns"])
            session.turn_ends = [int(n) for n in d.get("turn_ends", [])][-MAX_TURN_ENDS:]
        elif session.num_tokens:
            session.num_turns, session.turn_ends = 1, [session.num_tokens]
        session.conversation = bool(d.get("conversation", False))
        return session

    def record_turn(self, num_tokens: int, block_hashes: list[str]) -> None:
        """A finished turn left the session holding ``num_tokens`` tokens (full blocks
        ``block_hashes``). A turn whose blocks do not continue the ones held before rewrote the
        history: the earlier boundaries are dropped (a fork can no longer name them)."""
        kept = len(self.block_hashes)
        if block_hashes[:kept] != self.block_hashes[:len(block_hashes)] or num_tokens < self.num_tokens:
            self.turn_ends = []
        self.num_turns += 1
        self.turn_ends = [*self.turn_ends, num_tokens][-MAX_TURN_ENDS:]
        self.num_tokens = num_tokens
        self.block_hashes = block_hashes

    def tokens_after(self, turn: int | None) -> int:
        """Tokens the session held after ``turn`` (1-based; None: now); SessionInvalid for a turn it
        has not finished or whose boundary is no longer recorded."""
        if turn is None or turn == self.num_turns:
            return self.num_tokens
        first = self.num_turns - len(self.turn_ends) + 1
        if not 1 <= turn <= self.num_turns:
            raise SessionInvalid(f"'turn' must be between 1 and {max(self.num_turns, 1)}: session "
                                 f"'{self.session_id}' has finished {self.num_turns} turns, got {turn}",
                                 "invalid_turn", "turn")
        if turn < first:
            raise SessionInvalid(f"Session '{self.session_id}' no longer records where turn {turn} ended "
                                 f"(it keeps the latest {MAX_TURN_ENDS} turns, from turn {first}, and none "
                                 f"before a turn that rewrote the history)", "turn_not_recorded", "turn")
        return self.turn_ends[turn - first]


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

