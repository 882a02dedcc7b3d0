"""TieredStore: memory -> disk -> Redis as one store, fastest tier first.

Policy, in one place:

- lookup_prefix: the longest prefix of a chain found in any tier; each block may sit in a
  different tier (mixed tiers). One batched ``contains`` per tier, asked only for the blocks
  the tiers above did not have.
- get: tiers in order; a hit in a lower tier is promoted (copied into every tier above it).
- put(key, payload, from_tier): stores into tier ``from_tier`` and into every write-through tier
  below it. Redis is the write-through tier: it is shared, so a block saved by one replica is
  visible to the others at once rather than only after it trickles down.
- Demotion: a tier's put returns what it evicted (PutResult.evicted); those blocks are copied
  into the next tier, cascading down, unless that tier is write-through (it already has every
  block). The disk tier hands nothing down: it drops whole segments and everything in them was
  already written through to Redis.

The tiered store holds no lock of its own: each tier is thread-safe, and a block in flight
between tiers is at worst a miss for a moment, never wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhive.store.base import BlockStore, Payload, StoreStats
from kvhive.store.key import StoreKey


@dataclass(frozen=True)
class Tier:
    """One level of a TieredStore: a name for metrics and KV events, the store, its write policy."""

    name: str                    # "cpu", "disk", "redis": the medium in metrics and KV events
    store: BlockStore
    write_through: bool = False  # every put below it lands here too (a shared tier: Redis)


class TieredStore:
    """Stores ordered fastest first, with longest-prefix lookup, promotion on hit and demotion on evict."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = tuple(tiers)

    def lookup_prefix(self, keys: Sequence[StoreKey]) -> list[int]:
        """Tier index of each block of the longest prefix of ``keys`` held in any tier (top tier wins)."""
        found: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for tier_index, tier in enumerate(self.tiers):
            if not pending:
                break
            present = tier.store.contains([keys[i] for i in pending])
            for i, hit in zip(pending, present, strict=True):
                if hit:
                    found[i] = tier_index
            pending = [i for i in pending if found[i] is None]
        prefix: list[int] = []
        for tier_index in found:
            if tier_index is None:
                break
            prefix.append(tier_index)
        return prefix

    def get(self, key: StoreKey) -> Payload | None:
        """The payload from the first tier that has it, promoted into the tiers above; None on a miss."""
        for tier_index, tier in enumerate(self.tiers):
            payload = tier.store.get(key)
            if payload is not None:
                for upper in range(tier_index):
                    if not self.tiers[upper].write_through:
                        self._put_into(upper, key, payload)
                return payload
        return None

    def put(self, key: StoreKey, payload: Payload, from_tier: int = 0) -> bool:
        """Store into tier ``from_tier`` and every write-through tier below; True if any tier kept it."""
        if not 0 <= from_tier < len(self.tiers):
            raise ValueError(f"from_tier must be in [0, {len(self.tiers)}), got {from_tier}")
        stored = self._put_into(from_tier, key, payload)
        for tier_index in range(from_tier + 1, len(self.tiers)):
            if self.tiers[tier_index].write_through:
                stored = self._put_into(tier_index, key, payload) or stored
        return stored

    def delete(self, key: StoreKey) -> None:
        """Forget the block in every tier (including the shared one)."""
        for tier in self.tiers:
            tier.store.delete(key)

    def stats(self) -> dict[str, StoreStats]:
        """Each tier's stats, by tier name."""
        return {tier.name: tier.store.stats() for tier in self.tiers}

    def close(self) -> None:
        """Close every tier, top first (the disk tier writes its index snapshot)."""
        for tier in self.tiers:
            tier.store.close()

    def _put_into(self, tier_index: int, key: StoreKey, payload: Payload) -> bool:
        """Put into one tier and demote what it evicts into the next one, cascading down."""
        result = self.tiers[tier_index].store.put(key, payload)
        below = tier_index + 1
        if below < len(self.tiers) and not self.tiers[below].write_through:
            for evicted in result.evicted:
                self._put_into(below, evicted.key, evicted.payload)
        return result.stored
