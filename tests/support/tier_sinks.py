"""A TieredStore event sink that records what it hears and the view a consumer builds from it."""

from __future__ import annotations

from collections.abc import Sequence

from kvhive.store.tiered import TierChange


class RecordingSink:
    """Keeps every change and replays them into the view a consumer builds: tier -> hashes held."""

    def __init__(self) -> None:
        self.calls: list[list[TierChange]] = []

    def tiers_changed(self, changes: Sequence[TierChange]) -> None:
        """Record one store call's changes."""
        self.calls.append(list(changes))

    def view(self) -> dict[str, set[bytes]]:
        """Tier name -> block hashes held, after applying every recorded change in order."""
        held: dict[str, set[bytes]] = {}
        for changes in self.calls:
            for change in changes:
                tier = held.setdefault(change.tier, set())
                (tier.update if change.stored else tier.difference_update)(change.block_hashes)
        return held
