"""TieredStore: memory -> disk -> Redis as one store, fastest tier first.

Policy, in one place:

- lookup_prefix: the longest prefix of a chain found in any tier; each block may sit in a
  different tier (mixed tiers). One batched ``contains`` per tier, asked only for the blocks
  the tiers above did not have.
- get: tiers in order; a hit in a lower tier is promoted (copied into every tier above it,
  write-through ones included: a tier above the hit missed the block, e.g. a Redis hit saved by
  another replica lands on the local disk too).
- put(key, payload, from_tier): stores into tier ``from_tier`` and into every write-through tier
  below it. Redis is the write-through tier: it is shared, so a block saved by one replica is
  visible to the others at once rather than only after it trickles down.
- Demotion: a tier's put returns what it evicted (PutResult.evicted); those blocks are copied
  into the next tier, cascading down, unless that tier is write-through (it already has every
  block). The disk tier hands nothing down: it drops whole segments and everything in them was
  already written through to Redis.
- Pins (``pin_session``): live sessions name the blocks they hold; a block is pinned while any
  session holds it (refcounted). The *keeper*, the lowest tier with a byte budget of its own
  (disk if configured, else CPU memory), never evicts a pinned block; the tiers below it pin too
  (Redis takes the TTL off). Tiers above the keeper evict pinned blocks like any other, and a
  pinned block they evict is copied into the keeper if the keeper lacks it (demoted, not
  dropped). When the keeper's budget is all pinned it refuses new blocks, never drops pinned ones.

Each tier is thread-safe, and a block in flight between tiers is at worst a miss for a moment,
never wrong KV. The only lock here guards the pin table.

Tier events (``send_events_to``): once a sink is set, every call that changes a tier tells it, in
order, which blocks entered it (a put the tier kept, a promotion, a demotion) and which left it (an
eviction, a disk segment dropped, a delete), once per call, on the caller's thread. Calls on
different threads may report in another order than they changed the tiers; a consumer's view is a
hint (a block it thinks is held may be a miss), never wrong KV. Redis's own expiry and eviction are
not seen here, so they are not reported. ``restate_held`` lists what the local tiers hold with no
report in flight, so a consumer told to clear and then given that list is exact again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvhive.store.base import BlockStore, Payload, StoreStats
from kvhive.store.key import StoreKey


@dataclass(frozen=True)
class Tier:
    """One level of a TieredStore: a name for metrics and KV events, the store, its write policy."""

    name: str                    # "cpu", "disk", "redis": the medium in metrics and KV events
    store: BlockStore
    write_through: bool = False  # every put below it lands here too (a shared tier: Redis)


class TierChange(NamedTuple):
    """Blocks (by block hash) that entered (``stored``) or left one tier."""

    tier: str
    stored: bool
    block_hashes: tuple[bytes, ...]


class TierEventSink(Protocol):
    """Hears which blocks enter and leave the store's tiers (a replica's CPU/DISK/REMOTE KV events)."""

    def tiers_changed(self, changes: Sequence[TierChange]) -> None:
        """``changes`` happened in this order during one store call; runs on the caller's thread (a
        writer or fetcher), so it must not block."""
        ...


@dataclass(frozen=True)
class PinStats:
    """What live sessions pin in the store."""

    num_sessions: int     # sessions holding at least one pinned block
    num_blocks: int       # distinct pinned blocks (a block shared by sessions counts once)


class TieredStore:
    """Stores ordered fastest first, with longest-prefix lookup, promotion on hit and demotion on evict."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers = tuple(tiers)
        budgeted = [i for i, t in enumerate(self.tiers) if t.store.stats().budget_bytes is not None]
        self.keeper = budgeted[-1] if budgeted else 0     # index of the tier that keeps pinned blocks
        self._pin_lock = threading.Lock()
        # Invariant: _pin_counts[k] == number of sessions in _session_pins whose set holds k (> 0).
        self._session_pins: dict[str, frozenset[StoreKey]] = {}
        self._pin_counts: dict[StoreKey, int] = {}
        self._sink: TierEventSink | None = None
        # Held while the sink hears one call's changes, and while ``restate_held`` lists and announces.
        self._emit_lock = threading.Lock()

    def send_events_to(self, sink: TierEventSink, key_prefix: bytes) -> None:
        """Tell ``sink`` from now on which blocks enter and leave each tier, after announcing the
        blocks of this key space (``KeySpace.prefix``) that local tiers already hold (a disk tier's,
        from an earlier run). Redis is not listed: it is shared, and listing it would scan it."""
        for tier in self.tiers:
            if hasattr(tier.store, "track_drops"):
                tier.store.track_drops()
        self._sink = sink
        self._emit([change for change in self._held(key_prefix) if change.block_hashes])

    def restate_held(self, key_prefix: bytes, announce: Callable[[list[TierChange]], None]) -> list[TierChange]:
        """Call ``announce`` with what each local tier holds of this key space (one change per tier,
        empty ones included) while no other call reports to the sink, so a sink that hears the calls
        before, this, then the calls after ends with what the tiers hold. Returns those changes."""
        with self._emit_lock:
            for tier in self.tiers:
                self._take_drops(tier, [])       # dropped before this listing: it leaves them out
            held = self._held(key_prefix)
            announce(held)
        return held

    def drop_local(self) -> dict[str, int]:
        """Drop every block no live session pins from the tiers this process owns (memory, disk);
        a network tier (Redis) is shared with other replicas and keeps its blocks. Blocks dropped,
        by tier name. Nothing is reported to the sink: ``restate_held`` says what is left."""
        return {t.name: t.store.drop_unpinned() for t in self.tiers if hasattr(t.store, "drop_unpinned")}

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

    @property
    def num_tiers(self) -> int:
        """How many tiers the store has (index 0 is the fastest, the last the most durable)."""
        return len(self.tiers)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The tiers' names, fastest first."""
        return tuple(tier.name for tier in self.tiers)

    @property
    def has_network_tier(self) -> bool:
        """Whether any tier is reached over the network (Redis), so a call may wait on it."""
        return any(hasattr(tier.store, "available") for tier in self.tiers)

    def tier_available(self, tier_index: int) -> bool | None:
        """None for a local tier (it always answers); for a network tier, whether it is up now."""
        return getattr(self.tiers[tier_index].store, "available", None)

    def holds_all(self, tier_index: int, keys: Sequence[StoreKey]) -> bool:
        """Whether tier ``tier_index`` holds every one of these blocks; changes nothing, not even recency."""
        return all(self.tiers[tier_index].store.contains(keys))

    def count_in_tier(self, tier_index: int, keys: Sequence[StoreKey]) -> int:
        """How many of these blocks tier ``tier_index`` holds (0 for none asked, without a probe)."""
        return sum(self.tiers[tier_index].store.contains(keys)) if keys else 0

    def count_by_tier(self, keys: Sequence[StoreKey]) -> dict[str, int]:
        """How many of these blocks each tier holds, by tier name; changes nothing, not even recency."""
        return {tier.name: self.count_in_tier(i, keys) for i, tier in enumerate(self.tiers)}

    def get(self, key: StoreKey) -> Payload | None:
        """The payload from the first tier that has it, promoted into the tiers above; None on a miss."""
        changes: list[TierChange] = []
        found = None
        for tier_index, tier in enumerate(self.tiers):
            payload = tier.store.get(key)
            self._take_drops(tier, changes)          # a disk read may rewrite forward and drop
            if payload is not None:
                for upper in range(tier_index):
                    self._put_into(upper, key, payload, changes)
                found = payload
                break
        self._emit(changes)
        return found

    def put(self, key: StoreKey, payload: Payload, from_tier: int = 0) -> bool:
        """Store into tier ``from_tier`` and every write-through tier below; True if any tier kept it."""
        if not 0 <= from_tier < len(self.tiers):
            raise ValueError(f"from_tier must be in [0, {len(self.tiers)}), got {from_tier}")
        changes: list[TierChange] = []
        stored = self._put_into(from_tier, key, payload, changes)
        for tier_index in range(from_tier + 1, len(self.tiers)):
            if self.tiers[tier_index].write_through:
                stored = self._put_into(tier_index, key, payload, changes) or stored
        self._emit(changes)
        return stored

    def delete(self, key: StoreKey) -> None:
        """Forget the block in every tier (including the shared one)."""
        for tier in self.tiers:
            tier.store.delete(key)
        self._emit([TierChange(tier.name, False, (key.block_hash,)) for tier in self.tiers])

    def pin_session(self, session_id: str, keys: Iterable[StoreKey]) -> None:
        """The session now holds exactly these blocks: pin the new ones, unpin the ones it let go of
        (a block stays pinned while another session holds it)."""
        new = frozenset(keys)
        with self._pin_lock:
            old = self._session_pins.pop(session_id, frozenset())
            if new:
                self._session_pins[session_id] = new
            added = [k for k in new - old if self._count_pin(k, 1) == 1]
            removed = [k for k in old - new if self._count_pin(k, -1) == 0]
            # Under the lock, so a concurrent pin and unpin of one block reach the tiers in order.
            for tier in self.tiers[self.keeper:]:
                if added:
                    tier.store.pin(added)
                if removed:
                    tier.store.unpin(removed)

    def unpin_session(self, session_id: str) -> None:
        """The session ended: unpin the blocks no other session holds."""
        self.pin_session(session_id, ())

    def is_pinned(self, key: StoreKey) -> bool:
        """Whether a live session holds this block."""
        return key in self._pin_counts

    def pin_stats(self) -> PinStats:
        """How many sessions pin how many distinct blocks."""
        with self._pin_lock:
            return PinStats(len(self._session_pins), len(self._pin_counts))

    def pinned_keys(self) -> list[StoreKey]:
        """The distinct blocks live sessions pin."""
        with self._pin_lock:
            return list(self._pin_counts)

    def pinned_blocks_by_tier(self) -> dict[str, int]:
        """How many of the pinned blocks each tier holds, by tier name (one batched probe per tier)."""
        with self._pin_lock:
            keys = list(self._pin_counts)
        return self.count_by_tier(keys)

    def stats(self) -> dict[str, StoreStats]:
        """Each tier's stats, by tier name."""
        return {tier.name: tier.store.stats() for tier in self.tiers}

    def close(self) -> None:
        """Close every tier, top first (the disk tier writes its index snapshot)."""
        for tier in self.tiers:
            tier.store.close()

    def _put_into(self, tier_index: int, key: StoreKey, payload: Payload, changes: list[TierChange]) -> bool:
        """Put into one tier and demote what it evicts into the next one, cascading down; what
        entered and left each tier is appended to ``changes``."""
        tier = self.tiers[tier_index]
        result = tier.store.put(key, payload)
        self._take_drops(tier, changes)              # before the put's own block: it may be re-stored
        if result.stored:
            changes.append(TierChange(tier.name, True, (key.block_hash,)))
        if result.evicted:
            changes.append(TierChange(tier.name, False, tuple(e.key.block_hash for e in result.evicted)))
        below = tier_index + 1
        for evicted in result.evicted:
            if below < len(self.tiers) and not self.tiers[below].write_through:
                self._put_into(below, evicted.key, evicted.payload, changes)
            elif tier_index < self.keeper and self.is_pinned(evicted.key):
                # Write-through below usually has it already; a pinned block must not be lost.
                if not self.tiers[self.keeper].store.contains([evicted.key])[0]:
                    self._put_into(self.keeper, evicted.key, evicted.payload, changes)
        return result.stored

    def _held(self, key_prefix: bytes) -> list[TierChange]:
        """What each tier that can list its blocks (memory, disk; not Redis) holds of a key space."""
        return [TierChange(t.name, True, tuple(t.store.held_hashes(key_prefix)))
                for t in self.tiers if hasattr(t.store, "held_hashes")]

    def _take_drops(self, tier: Tier, changes: list[TierChange]) -> None:
        """Append the blocks ``tier`` dropped on its own (disk segments) since it was last asked."""
        if self._sink is not None and hasattr(tier.store, "take_dropped"):
            dropped = tier.store.take_dropped()
            if dropped:
                changes.append(TierChange(tier.name, False, tuple(dropped)))

    def _emit(self, changes: list[TierChange]) -> None:
        """Hand one call's changes to the sink, if there is one."""
        if self._sink is not None and changes:
            with self._emit_lock:
                self._sink.tiers_changed(changes)

    def _count_pin(self, key: StoreKey, delta: int) -> int:
        # Pin lock held; returns the new count (0: the key is gone from the table).
        count = self._pin_counts.get(key, 0) + delta
        if count > 0:
            self._pin_counts[key] = count
        else:
            self._pin_counts.pop(key, None)
        return count
