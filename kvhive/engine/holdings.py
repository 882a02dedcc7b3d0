"""What the store tiers hold for the engine: session pins, block counts by tier, the keeper's budget.

``TierHoldings`` answers from any thread (it touches only the store tiers, which are thread-safe).
With a network tier (Redis) it never makes the caller wait on the network for long: pin changes
run on a helper thread in call order, and a metrics read waits at most ``NETWORK_STATS_WAIT_S``
before reusing the tier's previous answer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from kvhive.engine.stats import TierBudget

if TYPE_CHECKING:
    from kvhive.store.key import KeySpace
    from kvhive.store.tiered import TieredStore

# How long a metrics read waits for a network tier (Redis) before reusing its previous answer.
NETWORK_STATS_WAIT_S = 0.25


class TierHoldings:
    """Session pins and block counts in the store tiers (none without tiers: every answer is empty)."""

    def __init__(self, store: TieredStore | None, key_space: KeySpace | None) -> None:
        self.store = store
        self.key_space = key_space
        self._lock = threading.Lock()                           # guards creating the helper threads
        self._network_stats: ThreadPoolExecutor | None = None    # asks a network tier for metrics
        self._network_counts: dict[str, int] = {}               # its last answers, by tier name
        self._pin_thread: ThreadPoolExecutor | None = None       # applies pins with a network tier

    def count_tier_blocks(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of these blocks each store tier holds, by tier name ({} without tiers or blocks)."""
        if self.store is None or not block_hashes:
            return {}
        return self.store.count_by_tier(self.key_space.keys(block_hashes))

    def keeper_budget(self) -> TierBudget | None:
        """The tier that keeps pinned session blocks and its byte budget; None without store tiers
        or when that tier has no budget of its own (Redis: its own memory limit applies)."""
        store = self.store
        if store is None:
            return None
        tier = store.tiers[store.keeper]
        budget = tier.store.stats().budget_bytes
        return None if budget is None else TierBudget(tier.name, budget)

    def pin_session(self, session_id: str, block_hashes: Sequence[bytes]) -> None:
        """Keep these blocks of a live session in the store tiers until ``unpin_session``; replaces
        the session's previous pins."""
        store = self.store
        if store is not None:
            keys = self.key_space.keys(block_hashes)
            self._apply_pins(lambda: store.pin_session(session_id, keys))

    def unpin_session(self, session_id: str) -> None:
        """Let the store tiers evict the session's blocks (those no other session pins)."""
        store = self.store
        if store is not None:
            self._apply_pins(lambda: store.unpin_session(session_id))

    def _apply_pins(self, change: Callable[[], None]) -> None:
        """Run a pin change now, or on the pin thread (in order) when a tier is on the network."""
        if not self.store.has_network_tier:
            change()
            return
        with self._lock:
            if self._pin_thread is None:
                self._pin_thread = ThreadPoolExecutor(1, thread_name_prefix="kvhive-tier-pins")
            self._pin_thread.submit(change)

    def pinned_blocks_by_tier(self) -> dict[str, int]:
        """How many of the distinct blocks live sessions pin each store tier holds.

        A network tier (Redis) is asked on a helper thread, waited for at most
        NETWORK_STATS_WAIT_S (then its previous answer stands); while it is down it holds 0."""
        store = self.store
        if store is None:
            return {}
        keys = store.pinned_keys()
        counts = {}
        for index, name in enumerate(store.tier_names):
            available = store.tier_available(index)
            if available is None:
                counts[name] = store.count_in_tier(index, keys)
            elif not available or not keys:
                counts[name] = 0
            else:
                counts[name] = self._network_count(name, index, keys)
        return counts

    def _network_count(self, name: str, tier_index: int, keys) -> int:
        """``store.count_in_tier(tier_index, keys)`` from a helper thread, or the last answer when slow."""
        store = self.store
        with self._lock:
            if self._network_stats is None:
                self._network_stats = ThreadPoolExecutor(1, thread_name_prefix="kvhive-tier-stats")
            future = self._network_stats.submit(lambda: store.count_in_tier(tier_index, keys))
        try:
            count = future.result(timeout=NETWORK_STATS_WAIT_S)
        except FutureTimeout:
            return self._network_counts.get(name, 0)
        self._network_counts[name] = count
        return count

    def close(self) -> None:
        """Finish the pin changes and reads in flight; from now on every answer is empty."""
        for helper in (self._pin_thread, self._network_stats):
            if helper is not None:
                helper.shutdown(wait=True)
        self._pin_thread = self._network_stats = None
        self.store = None
