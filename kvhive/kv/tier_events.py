"""Store tier changes -> KV events: the CPU, DISK and REMOTE media of a replica's blocks.

A ``TieredStore`` reports which blocks enter and leave each tier (``TierChange``); this sink turns
each report into one KV-event batch. Tier names map to vLLM's medium strings: ``cpu`` -> ``CPU``,
``disk`` -> ``DISK``, ``redis`` -> ``REMOTE`` (the Redis tier every replica pointing at it shares;
``--tier-weights REMOTE=...`` weights it in kvhive's gateway, ``remote`` in llm-d's backend configs).
A tier's ``BlockStored`` names blocks by hash only: no parent, no token ids. That is the
location-only form llm-d's indexer resolves through the device event that first stored each hash;
kvhive's gateway reads kvhive hashes as block keys directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvhive.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_REMOTE,
    BlockRemoved,
    BlockStored,
    KVEvent,
    normalize_medium,
)

if TYPE_CHECKING:
    from kvhive.kv.event_publisher import KVEventPublisher
    from kvhive.store.tiered import TierChange

TIER_MEDIA = {"cpu": MEDIUM_CPU, "disk": MEDIUM_DISK, "redis": MEDIUM_REMOTE}


def tier_medium(tier: str) -> str:
    """The KV-event medium of a store tier by its name (an unknown tier counts as REMOTE)."""
    return TIER_MEDIA.get(tier) or normalize_medium(tier)


def tier_change_events(changes: Sequence[TierChange], block_size: int) -> list[KVEvent]:
    """``BlockStored`` / ``BlockRemoved`` events for ``changes``, in order (empty changes left out)."""
    events: list[KVEvent] = []
    for change in changes:
        if not change.block_hashes:
            continue
        medium = tier_medium(change.tier)
        if change.stored:
            events.append(BlockStored(list(change.block_hashes), None, [], block_size, None, medium))
        else:
            events.append(BlockRemoved(list(change.block_hashes), medium))
    return events


class TierEventForwarder:
    """A TieredStore's event sink that publishes each store call's changes as one batch."""

    def __init__(self, publisher: KVEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size

    def tiers_changed(self, changes: Sequence[TierChange]) -> None:
        """Queue BlockStored / BlockRemoved events for ``changes``, in order (never blocks)."""
        self.publisher.publish(tier_change_events(changes, self.block_size))
