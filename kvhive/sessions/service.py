"""``SessionService``: when a session turn opens and ends, what the engine keeps for it, and expiry.

The HTTP layer validates a request and streams it; this service decides its session's lifecycle:

1. ``open_turn`` finds, creates or refuses the session (limits, busy, model) and marks it busy;
2. the request runs in the engine under ``SessionTurn.engine_id``;
3. ``SessionTurn.end`` records what the session holds now, slides its expiry and pins its blocks
   in the store tiers (or deletes it and releases its blocks: ``end_conversation``); the engine
   keeps them on the device only while no request needs the room, least recently used going first
   (``kvhive.engine.scheduler.session_spill``), and the record here stays whatever it does;
4. ``end`` (DELETE, a conversation left empty) and ``sweep`` (expiry) release a session's blocks.

Beside the turns: ``fork`` makes a session holding what another held after one of its turns, and
``pin_chain`` keeps a stored response's chain pinned after its conversation moved on to another
branch (``kvhive.sessions.chain_pins``).

The engine side is a ``SessionHolder`` (``kvhive.engine.client.EngineClient`` in the server).
Everything here runs on the server's event loop, like the registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvhive.config import SessionConfig
from kvhive.sessions.backends import SessionBackend
from kvhive.sessions.chain_pins import ChainPins
from kvhive.sessions.prefix_pins import PrefixPins
from kvhive.sessions.registry import (
    KeeperTier,
    Session,
    SessionNotDurable,
    SessionNotFound,
    SessionRegistry,
    SessionStale,
    SessionStats,
    parse_ttl,
)

if TYPE_CHECKING:
    from kvhive.config import StoreConfig
    from kvhive.engine.stats import TierBudget

# How long a request on a busy session waits for the running turn to end before it is refused
# (covers a client's own abort that the server has not processed yet), and how often it looks.
SESSION_BUSY_WAIT_S = 0.15
SESSION_BUSY_POLL_S = 0.005
# How often expired sessions (and stored responses) are swept and their blocks released.
SWEEP_INTERVAL_S = 1.0
# How often the sweep asks a shared backend (Redis) whether it lost its data (one GET).
DATA_CHECK_INTERVAL_S = 5.0


class SessionHolder(Protocol):
    """What the service needs of the engine: keep and let go of a session's blocks."""

    def hold_session(self, session_id: str, block_hashes: Sequence[bytes]) -> None:
        """Pin these blocks of the session in the store tiers, replacing its older pins."""

    def release_session(self, session_id: str) -> None:
        """Free the session's device blocks and drop its store pins."""

    async def fork_session(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give the child its own holding of the parent's device blocks (the full ones of its first
        ``num_tokens`` tokens), shared copy-on-write; the tokens shared (0: the parent holds none)."""


@dataclass(frozen=True)
class SessionTurn:
    """One turn of one session, open until ``end``; ``NO_TURN`` stands for a request outside any
    session (its ``end`` does nothing)."""

    service: SessionService | None
    session: Session | None
    number: int = 0                # the session's turn counter when this turn began
    end_session: bool = False      # the session is deleted when this turn ends
    created: bool = False          # the session was created for this turn

    @property
    def engine_id(self) -> str | None:
        """The id the engine holds the session's blocks under; None outside a session."""
        return None if self.session is None else self.session.engine_id

    def end(self, num_tokens: int | None = None, block_hashes: Sequence[bytes] | None = None,
            cached_tokens: int = 0) -> None:
        """End the turn (once: later calls, or calls after a newer turn began, do nothing).
        ``num_tokens``/``block_hashes``: what the session holds now, when the engine said so; then
        SessionNotDurable when its record cannot be written (``SessionService.end_turn``)."""
        if self.service is not None:
            self.service.end_turn(self, num_tokens, block_hashes, cached_tokens)


NO_TURN = SessionTurn(None, None)


def check_turn_number(session: Session | None, turn_number: int | None) -> None:
    """SessionStale unless ``turn_number`` (when sent) is the next turn of ``session`` (None: a new
    session, whose first turn is 1): a client that resends an old turn, or skips one, is told so."""
    if turn_number is None:
        return
    expected = 1 if session is None else session.num_turns + 1
    if turn_number == expected:
        return
    where = "a new session" if session is None else f"session '{session.session_id}'"
    done = 0 if session is None else session.num_turns
    stale = turn_number < expected
    advice = "resend it from the session's current state" if stale else "a turn is missing"
    raise SessionStale(f"'turn_number' is {turn_number}, but {where} has finished {done} turns, so this "
                       f"request would be turn {expected}: {advice}",
                       "stale_turn_number" if stale else "turn_number_ahead", "turn_number")


def keeper_tier(budget: TierBudget | None, store: StoreConfig) -> KeeperTier | None:
    """The pinned-budget rule's tier: the engine's keeper tier and budget, with the flag that sets
    it for messages; None without a budgeted tier (then only the per-key limits apply)."""
    if budget is None:
        return None
    options = {"cpu": f"--cpu-offload-gb {store.cpu_offload_gb:g}",
               "disk": f"--disk-cache-gb {store.disk_cache_gb:g}"}
    return KeeperTier(budget.name, budget.budget_bytes,
                      options.get(budget.name, f"the {budget.name} tier's budget"))


class SessionService:
    """Opens and ends session turns, pins and releases their blocks, and sweeps expired sessions."""

    def __init__(self, config: SessionConfig, holder: SessionHolder, *, block_bytes: int, block_size: int,
                 backend: SessionBackend | None = None, keeper: KeeperTier | None = None,
                 clock: Callable[[], float] = time.time, busy_wait_s: float = SESSION_BUSY_WAIT_S,
                 device_pool_bytes: int | None = None) -> None:
        """``keeper``: the tier that pins sessions' blocks (``keeper_tier``); ``device_pool_bytes``:
        the device KV pool's size; both size the limits (``kvhive.sessions.limits``)."""
        self.holder = holder
        self.busy_wait_s = busy_wait_s
        # The registry pins the sessions it loads from the backend (now, and on use when shared).
        self.registry = SessionRegistry(config, block_bytes, block_size, backend=backend, keeper=keeper,
                                        on_load=self.pin, clock=clock, device_pool_bytes=device_pool_bytes)
        self.config = config
        # Prompt-cache pins (cache_control, prompt_cache_retention) are records of this registry.
        self.prefix_pins = PrefixPins(self, block_size)
        self.chains = ChainPins(self.registry.limits, holder.hold_session)

    # ------------------------------------------------------------ turns

    async def open_turn(self, owner: str | None, model: str, num_tokens: int, *, session_id: str | None = None,
                        conversation_id: str | None = None, new_ttl: int | None = None,
                        end_session: bool = False, wait_if_busy: bool = True,
                        turn_number: int | None = None) -> SessionTurn:
        """The turn this request runs in, its session marked busy: a new session (``new_ttl``), the
        one named by ``session_id`` (must exist) or ``conversation_id`` (an unknown one starts a
        session with the default TTL), or ``NO_TURN``. ``num_tokens`` (prompt + max output) is
        checked against the limits; refusals raise ``SessionError`` kinds before anything changes.

        A session busy with another turn is waited for up to ``busy_wait_s`` before SessionBusy: a
        client that aborts a stream and sends its next turn at once may reach the server before
        the server has processed its disconnect (which ends the aborted turn); ``wait_if_busy``
        False raises it at once (for a caller that runs the request beside the session instead).
        ``turn_number``: the turn the client means this request to be; SessionStale unless it is the
        session's next one (``check_turn_number``)."""
        registry = self.registry
        name = session_id or conversation_id
        if new_ttl is not None:
            check_turn_number(None, turn_number)
            registry.check_pinned(owner, num_tokens)
            return self._turn(registry.create(owner, model, new_ttl), end_session, created=True)
        if not name:
            return NO_TURN
        try:
            session = await registry.aget(name, owner)
        except SessionNotFound:
            if session_id or conversation_id is None:
                raise
            check_turn_number(None, turn_number)
            registry.check_pinned(owner, num_tokens)
            evicted = registry.idle_conversation_to_evict()   # SessionLimit if all are busy
            session = registry.create(owner, model, self.config.default_ttl_s, session_id=conversation_id,
                                      conversation=True)
            if evicted is not None:
                self._evict(evicted)
            return self._turn(session, end_session, created=True)
        if session.busy and wait_if_busy and await self._wait_until_idle(session):
            session = await registry.aget(name, owner)        # as it is after that turn
        if not session.busy:
            check_turn_number(session, turn_number)
        registry.begin_turn(session, model, num_tokens)
        return self._turn(session, end_session)

    def _evict(self, session: Session) -> None:
        """End an idle conversation that a new one passed --max-active-conversations with (once the
        new one exists): its record and pins go, its blocks stay in the prefix cache."""
        self.registry.evict(session)
        self.holder.release_session(session.engine_id)

    def _turn(self, session: Session, end_session: bool, created: bool = False) -> SessionTurn:
        return SessionTurn(self, session, session.turn, end_session, created)

    async def _wait_until_idle(self, session: Session) -> bool:
        """Wait up to ``busy_wait_s`` for the session's running turn to end; True once it has."""
        deadline = time.monotonic() + self.busy_wait_s
        while session.busy and time.monotonic() < deadline:
            await asyncio.sleep(SESSION_BUSY_POLL_S)
        return not session.busy

    def end_turn(self, turn: SessionTurn, num_tokens: int | None, block_hashes: Sequence[bytes] | None,
                 cached_tokens: int = 0) -> None:
        """``SessionTurn.end``: record what the session holds, slide its expiry and pin its blocks
        (or, with ``end_session``, delete it and release them). Only the running turn ends. A
        finished turn whose record cannot be written raises SessionNotDurable (a session created
        for it is ended first)."""
        session = turn.session
        if session is None or not session.busy or session.turn != turn.number:
            return
        if turn.end_session:
            self.end(session)
            return
        hashes = None if block_hashes is None else [h.hex() for h in block_hashes]
        try:
            self.registry.end_turn(session, num_tokens, hashes, cached_tokens)
        except SessionNotDurable:
            # Its record could not be written; the one before stays. A session created for this
            # turn is not made at all; an older one keeps here what it holds now.
            if turn.created:
                self.end(session)
            elif block_hashes is not None:
                self.pin(session)
            if num_tokens is not None:
                raise                          # the finished turn answers the error
            return
        if block_hashes is not None:
            self.pin(session)

    # ------------------------------------------------------------ forks

    async def fork(self, owner: str | None, parent_id: str, ttl_s: int | None = None,
                   turn: int | None = None) -> tuple[Session, int]:
        """A new session holding what the caller's session ``parent_id`` held after ``turn`` (None:
        its latest), with TTL ``ttl_s`` (None: the parent's); its blocks are the parent's, pinned
        in the store tiers for it and shared on the device copy-on-write. The child and the tokens
        it shares on the device. Refusals (``SessionRegistry.fork``, SessionNotFound) change nothing."""
        parent = await self.registry.aget(parent_id, owner)
        child = self.registry.fork(parent, parent.ttl_s if ttl_s is None else ttl_s, turn)
        self.pin(child)
        shared = await self.holder.fork_session(parent.engine_id, child.engine_id, child.num_tokens)
        return child, shared

    # ------------------------------------------------------------ stored responses' chains

    def pin_chain(self, owner: str | None, response_id: str, block_hashes: list[str]) -> bool:
        """Pin a stored response's chain beside its conversation's session (``ChainPins.pin``);
        False when a limit leaves it unpinned."""
        return self.chains.pin(owner, response_id, block_hashes, self.registry.owned(owner))

    def unpin_chains(self, owner: str | None, response_ids: Iterable[str]) -> int:
        """Drop the chains pinned for these stored responses (deleted, or their conversation expired)."""
        return self.chains.unpin(owner, response_ids)

    # ------------------------------------------------------------ holdings

    def pin(self, session: Session) -> None:
        """Pin the blocks the session holds now in the store tiers (replacing its older pins)."""
        self.holder.hold_session(session.engine_id, [bytes.fromhex(h) for h in session.block_hashes])

    def end(self, session: Session) -> None:
        """Forget the session (here and in the backend) and release its blocks; a running turn
        releases its own when it ends."""
        self.registry.delete(session)
        self.holder.release_session(session.engine_id)

    def sweep(self) -> int:
        """Drop expired sessions and release their blocks; republish the sessions held here when
        the shared backend may lack them. How many expired."""
        expired = self.registry.pop_expired()
        for session in expired:
            self.holder.release_session(session.engine_id)
        self.registry.republish_if_wanted()
        return len(expired)

    async def run_sweeper(self) -> None:
        """Forever: ``sweep`` every SWEEP_INTERVAL_S, and ask a shared backend whether it lost its
        data every DATA_CHECK_INTERVAL_S."""
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()
            if time.monotonic() - last_check >= DATA_CHECK_INTERVAL_S:
                last_check = time.monotonic()
                await self.registry.check_backend()

    # ------------------------------------------------------------ lookups and TTLs

    async def find(self, session_id: str, owner: str | None) -> Session:
        """The caller's live session (read from a shared backend off the event loop); SessionNotFound otherwise."""
        return await self.registry.aget(session_id, owner)

    def live_sessions(self) -> list[Session]:
        """Every owner's live sessions (what a stopping replica hands to the shared tier)."""
        return self.registry.live_sessions()

    def list(self, owner: str | None) -> list[Session]:
        """The caller's live sessions on this replica, oldest first."""
        return self.registry.list(owner)

    def parse_ttl(self, value: object, param: str) -> int:
        """A TTL within the server's cap (``parse_ttl``); SessionInvalid otherwise."""
        return parse_ttl(value, self.config.max_ttl_s, param)

    def set_ttl(self, session: Session, ttl_s: int) -> None:
        """New TTL; the session now expires ttl_s from now."""
        self.registry.set_ttl(session, ttl_s)

    def stats(self) -> SessionStats:
        """The registry's snapshot for metrics."""
        return self.registry.stats()
