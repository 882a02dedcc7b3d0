"""Session spill: releasing idle sessions' device blocks when a request needs them.

A finished request with a ``session_id`` parks its blocks in the KV manager (pinned in the
device pool). With store tiers, when blocks run out, the least recently used holding whose full
blocks have a copy below is released to the pool (spilled) before anything is preempted; its next
request finds its blocks by prefix match, on the device or loaded back from the tiers.
``SessionCopy`` says where a holding's full blocks are: in the lowest tier (spill), on their way
there (saves in flight: wait a step), or not going there (the lowest tier is down, emptied or
full): then in a tier above (spill), or nowhere.

A holding with no copy anywhere, and every holding without tiers, follows the no-tier rule: when
the head of the waiting queue does not fit while nothing runs (``stuck``: nothing else will ever
free a block), the least recently used such holding is released, its full blocks cached in the
pool until evicted and recomputed after that. Idle sessions never stall a request forever.
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
    NONE = "none"          # no tier holds them all, and none will: the no-tier rule


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

    def spill(self, keep: str | None = None, stuck: bool = False) -> bool:
        """Release the least recently used holding (other than ``keep``) that may go; False if none.

        With tiers, one whose full blocks have a copy below (``SessionCopy.LOWEST`` or ``HIGHER``);
        one whose saves are still in flight waits (the partial last block is recomputed on resume).
        Without tiers, or when no tier holds a holding's blocks, only when ``stuck``.
        """
        if self.session_copy is None and not stuck:
            return False
        pending = self.pending_hashes()
        uncopied = None
        for session_id in self.kv.session_ids():
            if session_id == keep:
                continue
            copy = None if self.session_copy is None else self._copy_of(session_id, pending)
            if copy in (SessionCopy.LOWEST, SessionCopy.HIGHER) or (copy is None and stuck):
                self._release(session_id)
                return True
            if copy is SessionCopy.NONE:
                uncopied = uncopied or session_id
        if uncopied is not None and stuck:
            self._release(uncopied)          # recomputed on its next turn
            return True
        return False

    def _copy_of(self, session_id: str, pending: set[bytes]) -> SessionCopy:
        """Where the holding's full blocks are; PENDING while any is not yet handed to saves."""
        held = self.kv.session_blocks(session_id)
        hashes = held.block_hashes[:held.num_cached_blocks]
        if any(h in pending for h in hashes):
            return SessionCopy.PENDING
        return self.session_copy(hashes) if hashes else SessionCopy.LOWEST

    def _release(self, session_id: str) -> None:
        self.kv.release_session(session_id)
        self.num_spills += 1
