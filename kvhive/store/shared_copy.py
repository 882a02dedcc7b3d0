"""Copying blocks into the shared (write-through) tier from the tiers above it.

A block reaches the shared tier (Redis, or a disk dir other replicas read) when it is saved, but a
save can be skipped (the writer fell behind) or refused (Redis was down): the block is then held only
by this process's own tiers. Before a replica stops, whatever its sessions need is copied down so
that another replica finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvhive.store.key import StoreKey
from kvhive.store.tiered import TieredStore


@dataclass(frozen=True)
class SharedCopy:
    """What a copy into the shared tier found and moved."""

    tier: str                 # the shared tier's name
    blocks: int               # the distinct blocks asked for
    copied: int               # copied into the shared tier from the tiers above it
    in_shared_tier: int       # of the blocks asked for, held by the shared tier afterwards


def shared_tier_index(store: TieredStore | None) -> int | None:
    """The index of the store's shared (write-through) tier, or None when it has none."""
    if store is None:
        return None
    return next((i for i, tier in enumerate(store.tiers) if tier.write_through), None)


def copy_missing(store: TieredStore, tier: int, keys: Sequence[StoreKey]) -> int:
    """Copy the ``keys`` tier ``tier`` lacks from the tiers above it; how many were copied."""
    if not keys:
        return 0
    held = store.tiers[tier].store.contains(list(keys))
    copied = 0
    for key, present in zip(keys, held, strict=True):
        if present:
            continue
        payload = next((p for upper in store.tiers[:tier] if (p := upper.store.get(key)) is not None), None)
        if payload is not None and store.put(key, payload, from_tier=tier):
            copied += 1
    return copied


def copy_to_shared_tier(store: TieredStore | None, keys: Sequence[StoreKey]) -> SharedCopy | None:
    """Copy the ``keys`` the shared tier lacks into it; None when the store has no shared tier."""
    tier = shared_tier_index(store)
    if store is None or tier is None:
        return None
    copied = copy_missing(store, tier, keys)
    return SharedCopy(tier=store.tiers[tier].name, blocks=len(keys), copied=copied,
                      in_shared_tier=store.count_in_tier(tier, list(keys)))
