"""Prompt-cache pins: Anthropic's ``cache_control`` breakpoints and OpenAI's ``prompt_cache_retention``.

A breakpoint asks that the prompt's first ``num_tokens`` tokens stay cached for ``ttl_s`` seconds
after their last use. Each breakpoint is one pin: a ``Session`` record of kind ``PIN_KIND`` in the
``SessionRegistry``, so pins are listed with the key's sessions, count in its budgets
(``--max-sessions-per-key``, ``--max-pinned-gb``, the keeper tier's rule), persist in the session
backend (a restart with a disk dir or Redis keeps them), keep their full blocks in the store tiers
(``SessionHolder.hold_session``) and are released by the expiry sweep like any session.

Rules, in one place:

- A pin is owned by the API key (the owner digest sessions use) and named by a digest of the model,
  the cache salt and the prefix's tokens (``pin_ids``): the same prefix from the same key is one pin,
  and another key never finds it (its cache salt keeps the KV apart as well).
- On the device a pin is only a retention priority: ``PinTurn.retention`` ranges ``[0, num_tokens)``
  at ``PINNED_PRIORITY`` for the TTL, which the device pool honours (pins are priorities). A pin
  ``in_memory`` (OpenAI's ``in_memory`` retention) is nothing more: its record is never written
  and no store tier keeps its blocks, so it takes no room in the keeper tier and ends with the
  process; it still counts in the key's session count and KV.
- Each request that carries a breakpoint refreshes its pin: it expires ``ttl_s`` after this request
  (a later expiry it had stays). A new pin's record is made when its request opens (busy, counted
  in the budgets) and holds the prefix's blocks once the engine has computed the prompt.
- Counters, with Anthropic's meanings (``PinTurn.cache_usage``): ``cache_read_input_tokens`` are the
  prompt tokens up to the furthest breakpoint whose pin was live before this request (or the
  furthest earlier prefix of the prompt another live pin of the key holds: the previous turn's,
  when a conversation moves its breakpoint to its newest turn), and served from cache (at most the
  engine's ``cached_tokens``); ``cache_creation_input_tokens`` the rest up
  to the last breakpoint; ``input_tokens`` the tokens after it. The three sum to the prompt. Once a
  pin has expired the same prefix counts as created again, even when the automatic prefix cache
  still had its KV (which OpenAI's ``cached_tokens`` would count).

Everything here runs on the server's event loop, like the registry.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhive.core.retention import PINNED_PRIORITY, RetentionSpec
from kvhive.sessions.errors import SessionInvalid, SessionNotDurable, SessionNotFound
from kvhive.sessions.session import PIN_KIND, Session

if TYPE_CHECKING:
    from kvhive.sessions.service import SessionService

# Anthropic's bound on the breakpoints of one request.
MAX_BREAKPOINTS = 4
# What starts a pin's id: '@' is outside the session-id alphabet, so no request can name a pin as
# its session (``x-session-id``, ``conversation_id``), while ``/v1/context/{id}`` can show it.
PIN_ID_PREFIX = "pin@"


@dataclass(frozen=True)
class Breakpoint:
    """Pin prompt tokens ``[0, num_tokens)`` for ``ttl_s`` seconds after their last use;
    ``in_memory``: only as a device priority (no store-tier pin, no persisted record)."""

    num_tokens: int
    ttl_s: int
    in_memory: bool = False


@dataclass(frozen=True)
class CacheUsage:
    """A request's prompt split Anthropic's way; the three fields sum to the prompt's length."""

    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    input_tokens: int


def pin_ids(model: str, cache_salt: str | None, prompt_token_ids: Sequence[int],
            breakpoints: Sequence[Breakpoint]) -> list[str]:
    """The id of each breakpoint's pin, a digest of the model, the salt, the prefix
    ``prompt_token_ids[:num_tokens]`` and whether it is held in memory only; breakpoints in
    ascending order, one pass over the prompt."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (model, cache_salt or ""):
        raw = part.encode()
        digest.update(len(raw).to_bytes(4, "little") + raw)
    ids, start = [], 0
    for bp in breakpoints:
        digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in prompt_token_ids[start:bp.num_tokens]))
        start = max(start, bp.num_tokens)
        snapshot = digest.copy()
        snapshot.update(bp.num_tokens.to_bytes(8, "little") + bytes([bp.in_memory]))
        ids.append(PIN_ID_PREFIX + snapshot.hexdigest())
    return ids


def checked_breakpoints(breakpoints: Sequence[Breakpoint], num_prompt_tokens: int, max_ttl_s: int,
                        param: str) -> tuple[Breakpoint, ...]:
    """The breakpoints by position, two alike at one position merged (the longer TTL); SessionInvalid
    (naming ``param``) for more than MAX_BREAKPOINTS, a position outside ``[1, num_prompt_tokens]``,
    or a TTL outside ``(0, max_ttl_s]`` (--max-session-ttl)."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise SessionInvalid(f"A request may carry at most {MAX_BREAKPOINTS} cache breakpoints, got "
                             f"{len(breakpoints)}", "too_many_breakpoints", param)
    merged: dict[tuple[int, bool], int] = {}
    for bp in breakpoints:
        if not 1 <= bp.num_tokens <= num_prompt_tokens:
            raise SessionInvalid(f"A cache breakpoint at token {bp.num_tokens} lies outside the prompt's "
                                 f"{num_prompt_tokens} tokens", "invalid_breakpoint", param)
        if bp.ttl_s <= 0:
            raise SessionInvalid(f"A cache breakpoint's TTL must be positive, got {bp.ttl_s}s",
                                 "invalid_cache_ttl", param)
        if bp.ttl_s > max_ttl_s:
            raise SessionInvalid(f"A cache retention of {bp.ttl_s}s is longer than this server allows: "
                                 f"at most {max_ttl_s}s (--max-session-ttl)", "cache_ttl_too_long", param)
        key = (bp.num_tokens, bp.in_memory)
        merged[key] = max(bp.ttl_s, merged.get(key, 0))
    return tuple(Breakpoint(n, merged[n, memory], memory) for n, memory in sorted(merged))


def split_usage(num_prompt_tokens: int, last_breakpoint: int, read_limit: int, cached_tokens: int) -> CacheUsage:
    """Anthropic's counters: read up to ``read_limit`` (the furthest breakpoint pinned before the
    request) as far as the engine served from cache, created up to ``last_breakpoint``, the rest input."""
    read = max(0, min(read_limit, cached_tokens, last_breakpoint))
    return CacheUsage(read, last_breakpoint - read, num_prompt_tokens - last_breakpoint)


class PinTurn:
    """One request's pins, open until ``end``: what it asks the device to retain, and its counters."""

    def __init__(self, pins: PrefixPins | None, num_prompt_tokens: int, breakpoints: tuple[Breakpoint, ...] = (),
                 records: tuple[Session, ...] = (), created: tuple[bool, ...] = (), read_limit: int = 0) -> None:
        self._pins = pins
        self.num_prompt_tokens = num_prompt_tokens
        self.breakpoints = breakpoints
        self._records = records          # one pin record per breakpoint
        self._created = created          # whether this request created that record
        self.read_limit = read_limit     # the furthest prefix a live pin held before the request
        self.usage: CacheUsage | None = None      # set by ``end``

    @property
    def retention(self) -> RetentionSpec | None:
        """Each breakpoint's prefix at PINNED_PRIORITY for its TTL; None without breakpoints."""
        if not self.breakpoints:
            return None
        spec = RetentionSpec()
        for bp in self.breakpoints:
            spec = spec.with_pin(bp.num_tokens, float(bp.ttl_s), PINNED_PRIORITY)
        return spec

    def merged_retention(self, client: RetentionSpec | None) -> RetentionSpec | None:
        """The client's own retention (``kv_cache_retention_config``) plus these pins."""
        if client is None:
            return self.retention
        for bp in self.breakpoints:
            client = client.with_pin(bp.num_tokens, float(bp.ttl_s), PINNED_PRIORITY)
        return client

    def cache_usage(self, cached_tokens: int) -> CacheUsage:
        """The counters for a request the engine served ``cached_tokens`` prompt tokens of from
        cache (changes nothing: a stream may report them before the request ends)."""
        last = self.breakpoints[-1].num_tokens if self.breakpoints else 0
        return split_usage(self.num_prompt_tokens, last, self.read_limit, cached_tokens)

    def end(self, block_hashes: Sequence[bytes] | None, cached_tokens: int) -> CacheUsage:
        """End the turn (once; later calls return the first answer): with the prompt's full-block
        hashes (the engine computed it) each pin is written or refreshed and its blocks held in the
        store tiers; without them a pin this request created is dropped. The counters."""
        if self.usage is None:
            self.usage = self.cache_usage(cached_tokens)
            if self._pins is not None:
                self._pins.end_turn(self, block_hashes)
        return self.usage

    def pins(self) -> list[tuple[Breakpoint, Session, bool]]:
        """Each breakpoint with its pin record and whether this request created it."""
        return list(zip(self.breakpoints, self._records, self._created, strict=True))


class PrefixPins:
    """Opens and ends the pin turns of requests that carry breakpoints, over a ``SessionService``."""

    def __init__(self, service: SessionService, block_size: int) -> None:
        self.service = service
        self.registry = service.registry
        self.block_size = block_size

    async def open(self, owner: str | None, model: str, prompt_token_ids: Sequence[int],
                   breakpoints: Sequence[Breakpoint], *, cache_salt: str | None = None,
                   param: str = "cache_control") -> PinTurn:
        """The pins this request reads and writes. SessionInvalid (a bad breakpoint, a TTL over
        --max-session-ttl, naming ``param``) and SessionLimit (the key's session count or KV, the
        keeper tier) are raised before anything changes; then each live pin is held through the
        request and each missing one is created (busy until the request ends)."""
        num_prompt = len(prompt_token_ids)
        points = checked_breakpoints(breakpoints, num_prompt, self.service.config.max_ttl_s, param)
        if not points:
            return PinTurn(None, num_prompt)
        ids = pin_ids(model, cache_salt, prompt_token_ids, points)
        held = [await self._find(pin_id, owner) for pin_id in ids]
        # Awaits end here: the checks below and the changes after them see one state.
        live = [bp.num_tokens for bp, pin in zip(points, held, strict=True) if pin is not None and not pin.busy]
        read_limit = max(live, default=0)
        read_limit = max(read_limit, self._earlier_pin(owner, model, cache_salt, prompt_token_ids,
                                                       points[-1].num_tokens, read_limit))
        missing = [bp for bp, pin in zip(points, held, strict=True) if pin is None]
        self._check_room(owner, missing, points, held)
        now = self.registry.clock()
        records, created = [], []
        try:
            for bp, pin_id, pin in zip(points, ids, held, strict=True):
                if pin is None:
                    pin = self.registry.create(owner, model, bp.ttl_s, session_id=pin_id, kind=PIN_KIND,
                                               num_tokens=bp.num_tokens, in_memory=bp.in_memory)
                    created.append(True)
                else:
                    pin.expires = max(pin.expires, now + bp.ttl_s)   # held through the request (not written)
                    created.append(False)
                records.append(pin)
        except SessionNotDurable:
            for pin, new in zip(records, created, strict=False):
                if new:
                    self.service.end(pin)
            raise
        return PinTurn(self, num_prompt, points, tuple(records), tuple(created), read_limit)

    def _earlier_pin(self, owner: str | None, model: str, cache_salt: str | None, prompt_token_ids: Sequence[int],
                     up_to: int, above: int) -> int:
        """The furthest prefix of this prompt in ``(above, up_to]`` that another live, idle pin of the
        owner on this replica holds; 0 when none. Anthropic reads a cache entry written at an earlier
        position too: a conversation moves its breakpoint to its newest turn on every request, and
        the prefix the previous request pinned is then read, not created again."""
        pins = [pin for pin in self.registry.list(owner)
                if pin.is_pin and not pin.busy and pin.model == model and above < pin.num_tokens <= up_to]
        if not pins:
            return 0
        # Each distinct position once, in ascending order: one pass over the prompt names them all.
        positions = sorted({(pin.num_tokens, pin.in_memory) for pin in pins})
        ids = pin_ids(model, cache_salt, prompt_token_ids, [Breakpoint(n, 1, in_memory) for n, in_memory in positions])
        held = {pin.session_id for pin in pins}
        return max((n for (n, _), pin_id in zip(positions, ids, strict=True) if pin_id in held), default=0)

    async def _find(self, pin_id: str, owner: str | None) -> Session | None:
        """The owner's live pin of this id, or None."""
        try:
            pin = await self.registry.aget(pin_id, owner)
        except SessionNotFound:
            return None
        return pin if pin.is_pin else None

    def _check_room(self, owner: str | None, missing: list[Breakpoint], points: tuple[Breakpoint, ...],
                    held: list[Session | None]) -> None:
        """SessionLimit when the new pins would take the key over its session count or KV, or the
        server's pins over the keeper tier (nested pins share blocks: only the tokens past the
        furthest pin held there below the furthest new one are new there; pins held in memory
        only take no room there)."""
        if not missing:
            return
        self.registry.check_session_count(owner, len(missing))
        stored = [bp.num_tokens for bp in missing if not bp.in_memory]
        furthest_new = max(stored, default=0)
        below = max((bp.num_tokens for bp, pin in zip(points, held, strict=True)
                     if pin is not None and not bp.in_memory and bp.num_tokens < furthest_new), default=0)
        self.registry.check_pinned(owner, sum(bp.num_tokens for bp in missing),
                                   keeper_tokens=max(0, furthest_new - below))

    def end_turn(self, turn: PinTurn, block_hashes: Sequence[bytes] | None) -> None:
        """``PinTurn.end``'s changes: write or refresh each pin with its prefix's full blocks, or drop
        the pins this request created when it never computed its prompt."""
        for bp, pin, created in turn.pins():
            num_full = bp.num_tokens // self.block_size
            if block_hashes is None or len(block_hashes) < num_full:
                if created and pin.busy:
                    self.service.end(pin)
                continue
            hashes = [h.hex() for h in block_hashes[:num_full]]
            changed = hashes != pin.block_hashes
            # A record that cannot be written is logged by the records; the pin holds here all the same.
            with contextlib.suppress(SessionNotDurable):
                self.registry.refresh_pin(pin, bp.num_tokens, hashes, bp.ttl_s)
            if changed and not pin.in_memory and self.registry.holds(pin):   # not deleted or swept meanwhile
                self.service.pin(pin)
