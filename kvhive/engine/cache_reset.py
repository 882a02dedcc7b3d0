"""A prefix-cache reset (``POST /reset_prefix_cache``), run on the engine's loop thread between steps.

1. The device pool forgets every cached block that no request (running, loading, saving) and no
   session holds; held blocks keep their hashes and stay shareable.
2. With ``reset_external``, the store tiers this process owns (CPU memory, local disk) drop every
   block no live session pins. The shared Redis tier is never touched: other replicas read it.
3. The KV-event stream gets one batch: ``AllBlocksCleared``, the device blocks still held (with
   parents and token ids, as the pool announces new blocks), then what each local tier still holds.
   The tiers' own reports are held back while that batch is listed and queued, so a consumer that
   applies the stream in order ends with exactly what the replica holds. Redis is not listed (as at
   start): a consumer forgets which Redis blocks this replica wrote until they are written again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhive.core.kv_events import AllBlocksCleared, KVEvent
from kvhive.kv.tier_events import tier_change_events

if TYPE_CHECKING:
    from kvhive.engine.scheduler import Scheduler
    from kvhive.kv.event_publisher import KVEventPublisher
    from kvhive.store.tiered import TierChange, TieredStore

DEVICE = "device"


@dataclass(frozen=True)
class CacheReset:
    """Blocks a reset dropped and blocks still held: "device", then each local store tier by name."""

    dropped: dict[str, int]
    kept: dict[str, int]


def reset_caches(scheduler: Scheduler, store: TieredStore | None, key_prefix: bytes,
                 publisher: KVEventPublisher | None, block_size: int, reset_external: bool) -> CacheReset:
    """Reset the device prefix cache (and, with ``reset_external``, the local store tiers) and
    publish AllBlocksCleared followed by what is still held; loop thread only."""
    device = scheduler.reset_prefix_cache()
    dropped = {DEVICE: device.num_dropped}
    if reset_external and store is not None:
        dropped.update(store.drop_local())

    def announce(held: Sequence[TierChange]) -> None:
        if publisher is not None:
            events: list[KVEvent] = [AllBlocksCleared(), *device.stored]
            publisher.publish(events + tier_change_events(held, block_size))

    held = [] if store is None else store.restate_held(key_prefix, announce)
    if store is None:
        announce(())
    kept = {DEVICE: device.num_kept, **{change.tier: len(change.block_hashes) for change in held}}
    return CacheReset(dropped, kept)
