"""Session spill: releasing idle sessions' device blocks when a request needs them.

A finished request with a ``session_id`` parks its blocks in the KV manager (pinned in the
device pool). When a running or waiting request needs blocks that the free and evictable blocks
cannot give, idle holdings are released to the pool (spilled), least recently used first, before
anything is preempted and before a waiting request is made to wait. A spilled holding's full
blocks stay cached (evictable), so its next turn still hits whatever nobody evicted meanwhile, and
loads or recomputes the rest; the session's record (its tokens and hashes, kept by
``kvhive.sessions``) is untouched: only its device pins go.

With store tiers, holdings whose full blocks have a copy below go first (their next turn loads
them back). ``SessionCopy`` says where a holding's full blocks are: in the lowest tier, on their
way there (saves in flight: that holding waits, since its blocks are the saves' sources), or not
going there (the lowest tier is down, emptied or full): then in a tier above, or nowhere. A
holding with no copy anywhere, and every holding without tiers, goes after those, in the same
least-recently-used order, and is recomputed on its next turn. Idle sessions never hold the pool
against running requests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvhive.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from kvhive.store.key import KeySpace, StoreKey
    from kvhive.store.tiered import TieredStore


class SessionCopy(enum.Enum):
    """Where the store tiers hold copies of an idle session's full blocks."""

    LOWEST = "lowest"      # the lowest tier holds every one: spill
    PENDING = "pending"    # saves of some are still on their way to it: wait
    HIGHER = "higher"      # it will not get them (down, emptied, full), a tier above holds them all: spill
    NONE = "none"          # no tier holds them all, and none will: spilled after the others


class TierSessionCopy:
    """``session_copy`` over a TieredStore: where its tiers hold a holding's full blocks.

    The lowest (most durable) tier first. When it lacks some and no save of them is in flight,
    it will not get them (it was down or full when they were saved, or lost them since: a Redis
    restarted or flushed): then any tier above that holds them all. Changes nothing in the store;
    a tier that is down answers at once (its breaker is open).
    """

    def __init__(self, store: TieredStore, key_space: KeySpace,
                 is_saving: Callable[[Sequence[StoreKey]], bool] | None = None) -> None:
        """``is_saving(keys)``: whether a save of any of these blocks is queued or being written."""
        self.store = store
        self.key_space = key_space
        self.is_saving = is_saving

    def __call__(self, block_hashes: Sequence[bytes]) -> SessionCopy:
        """Where the tiers hold copies of these full blocks."""
        keys = self.key_space.keys(block_hashes)
        lowest = self.store.num_tiers - 1
        if self.store.holds_all(lowest, keys):
            return SessionCopy.LOWEST
        if self.is_saving is not None and self.is_saving(keys):
            return SessionCopy.PENDING
        for tier_index in reversed(range(lowest)):
            if self.store.holds_all(tier_index, keys):
                return SessionCopy.HIGHER
        return SessionCopy.NONE


class SessionSpill:
    """Releases idle session holdings to the device pool under pressure; counts the spills."""

    def __init__(self, kv: KVCacheManager, session_copy: Callable[[Sequence[bytes]], SessionCopy] | None,
                 pending_hashes: Callable[[], set[bytes]]) -> None:
        """``session_copy(hashes)``: where the tiers hold these full blocks (None: no tiers);
        ``pending_hashes()``: blocks computed but not yet handed to the connector's saves."""
        self.kv = kv
        self.session_copy = session_copy
        self.pending_hashes = pending_hashes
        self.num_spills = 0

    def spill(self, keep: str | None = None) -> bool:
        """Release one idle holding (other than ``keep``) to the pool; False if none may go.

        The least recently used holding whose full blocks have a copy below (``SessionCopy.LOWEST``
        or ``HIGHER``); else the least recently used one with no copy anywhere (every holding
        without tiers). A holding whose saves are still in flight waits (``PENDING``).
        """
        pending = self.pending_hashes()
        uncopied = None
        for session_id in self.kv.sessions.ids():
            if session_id == keep:
                continue
            if self.session_copy is None:
                self._release(session_id)
                return True
            copy = self._copy_of(session_id, pending)
            if copy in (SessionCopy.LOWEST, SessionCopy.HIGHER):
                self._release(session_id)
                return True
            if copy is SessionCopy.NONE:
                uncopied = uncopied or session_id
        if uncopied is not None:
            self._release(uncopied)          # recomputed on its next turn
            return True
        return False

    def _copy_of(self, session_id: str, pending: set[bytes]) -> SessionCopy:
        """Where the holding's full blocks are; PENDING while any is not yet handed to saves."""
        held = self.kv.sessions.get(session_id)
        hashes = held.block_hashes[:held.num_cached_blocks]
        if any(h in pending for h in hashes):
            return SessionCopy.PENDING
        return self.session_copy(hashes) if hashes else SessionCopy.LOWEST

    def _release(self, session_id: str) -> None:
        self.kv.sessions.release(session_id, spill=True)    # pinned until the session ends
        self.num_spills += 1
