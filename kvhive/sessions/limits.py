"""The limits on what sessions hold: per API key (live sessions, KV) and in the keeper tier that pins them.

``SessionLimits`` counts the distinct full blocks the registry's sessions hold and refuses, with
``SessionLimit``, a session or a turn that would take its key or the keeper tier over a limit; the
registry asks it before anything changes.

The per-key KV limit (``--max-pinned-gb``) defaults to ``KEY_PINNED_SHARE`` of the room sessions
may pin: in the keeper tier (the lowest with a budget: disk, else CPU memory), the share of its
budget kept for sessions; without one, the device pool. One key can then never take that room
alone: the keeper tier stays open to other keys' sessions, and without tiers one key's sessions
claim at most half the pool (their device pins give way to running requests in any case:
``kvhive.engine.scheduler.session_spill``). The default divides room between API keys, so it
applies to callers with one; a server without ``--api-key`` serves one tenant, whom only a limit
set in GiB bounds (the keeper tier's server-wide rule bounds everyone).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvhive.config import PINNED_AUTO, SessionConfig
from kvhive.sessions.errors import SessionLimit
from kvhive.sessions.session import Session

# The share of the keeper tier's budget kept free of session pins: room for block headers, for the
# disk tier's partly filled segments, and for the blocks other requests pass through the tier.
KEEPER_MARGIN = 0.10
# --max-pinned-gb auto: the share of that room (or of the device pool) one API key's sessions may hold.
KEY_PINNED_SHARE = 0.5


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
class KeyPinnedLimit:
    """The KV bytes one API key's sessions may hold, and the setting that says so (for messages)."""

    num_bytes: int
    source: str            # "--max-pinned-gb 2", or what the default is a share of
    keyed_only: bool = False      # the default share: callers without an API key are one tenant, not limited


def key_pinned_limit(config: SessionConfig, keeper: KeeperTier | None,
                     device_pool_bytes: int | None) -> KeyPinnedLimit | None:
    """``--max-pinned-gb`` in bytes: as set, or by default ``KEY_PINNED_SHARE`` of the keeper tier's
    session room, else of the device pool; None for no limit (``none``, or a default with no size known)."""
    setting = config.max_pinned_gb
    if setting is None:
        return None
    if setting != PINNED_AUTO:
        return KeyPinnedLimit(int(setting * 2**30), f"--max-pinned-gb {setting:g}")
    if keeper is not None:
        room, where = keeper.session_budget_bytes, f"what sessions may pin in the {keeper.name} tier"
    elif device_pool_bytes is not None:
        room, where = device_pool_bytes, "the device KV pool"
    else:
        return None
    return KeyPinnedLimit(int(room * KEY_PINNED_SHARE),
                          f"--max-pinned-gb {PINNED_AUTO}: {KEY_PINNED_SHARE:.0%} of {where}, {format_bytes(room)}",
                          keyed_only=True)



def format_bytes(num_bytes: float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1, e.g. ``52.4 KiB``."""
    value, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


class SessionLimits:
    """The per-key and keeper-tier limits over the blocks the registry's sessions hold."""

    def __init__(self, config: SessionConfig, block_bytes: int, block_size: int,
                 keeper: KeeperTier | None = None, device_pool_bytes: int | None = None) -> None:
        """``device_pool_bytes``: the device KV pool's size, the default per-key limit's base
        without a keeper tier (None: unknown, then only a set --max-pinned-gb limits a key)."""
        self.config = config
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.bytes_per_token = block_bytes / block_size
        self.keeper = keeper
        self.key_limit = key_pinned_limit(config, keeper, device_pool_bytes)
        # Invariant: _block_refs[h] == number of sessions the registry holds whose block_hashes hold h (> 0).
        self._block_refs: Counter[str] = Counter()

    def count_blocks(self, block_hashes: list[str], delta: int) -> None:
        """Count a held session's blocks in (``delta`` 1) or out (-1)."""
        for h in set(block_hashes):
            count = self._block_refs[h] + delta
            if count > 0:
                self._block_refs[h] = count
            else:
                del self._block_refs[h]

    def pinned_bytes(self, sessions: Iterable[Session]) -> int:
        """KV bytes these sessions hold."""
        return int(sum(s.num_tokens for s in sessions) * self.bytes_per_token)

    def pinned_block_bytes(self, exclude: Session | None = None) -> int:
        """Bytes of the distinct full blocks all sessions pin (less those only ``exclude`` pins)."""
        num_blocks = len(self._block_refs)
        if exclude is not None:
            num_blocks -= sum(1 for h in set(exclude.block_hashes) if self._block_refs[h] == 1)
        return num_blocks * self.block_bytes

    def check_session_count(self, num_live: int) -> None:
        """SessionLimit when a key holding ``num_live`` live sessions may not create another."""
        limit = self.config.max_sessions_per_key
        if limit is not None and num_live >= limit:
            raise SessionLimit(f"This API key already has {limit} live sessions "
                               f"(--max-sessions-per-key); delete one or let one expire",
                               "too_many_sessions")

    def check_pinned(self, owner: str | None, owned: Iterable[Session], num_tokens: int,
                     exclude: Session | None = None, keeper_tokens: int | None = None) -> None:
        """SessionLimit when a session holding ``num_tokens`` (prompt + max_tokens) in place of ``exclude``
        would take the key's sessions (``owner``'s, ``owned``; None: no API key) over --max-pinned-gb,
        or all sessions over the keeper tier (``keeper_tokens``, default ``num_tokens``: the tokens
        whose full blocks are new there; nested pins of one prompt share their blocks)."""
        self._check_key_limit(owner, owned, num_tokens, exclude)
        self._check_keeper(num_tokens if keeper_tokens is None else keeper_tokens, exclude)

    def _check_key_limit(self, owner: str | None, owned: Iterable[Session], num_tokens: int,
                         exclude: Session | None) -> None:
        limit = self.key_limit
        if limit is None or (owner is None and limit.keyed_only):
            return
        held_tokens = sum(s.num_tokens for s in owned if s is not exclude)
        wanted_tokens = held_tokens + num_tokens
        wanted = wanted_tokens * self.bytes_per_token
        if wanted > limit.num_bytes:
            raise SessionLimit(f"This API key's sessions would hold {wanted_tokens} tokens "
                               f"({format_bytes(wanted)}) of KV, over its limit of {format_bytes(limit.num_bytes)} "
                               f"({limit.source}): {held_tokens} tokens held "
                               f"by its sessions, {num_tokens} for this request (prompt + max_tokens). "
                               f"Delete a session, let one expire, or send a shorter request",
                               "session_kv_limit")

    def _check_keeper(self, num_tokens: int, exclude: Session | None) -> None:
        # The keeper never evicts a pinned block and refuses new ones when its budget is all
        # pinned: sessions pinning more than it can hold would leave it no room for other blocks.
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
