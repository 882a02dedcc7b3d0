"""Builds both disaggregation halves around the engine's connector (or none)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from kvhive.connector.disagg.scheduler_half import DisaggScheduler
from kvhive.connector.disagg.transfer_config import KVTransferConfig
from kvhive.connector.disagg.worker import DisaggWorker
from kvhive.store.key import KeySpace


class DisaggHalves(NamedTuple):
    """The scheduler and worker halves an engine hands its scheduler and runner."""

    scheduler: DisaggScheduler
    worker: DisaggWorker


def build_disagg(config: KVTransferConfig, key_space: KeySpace, root: bytes, num_layers: int, inner_scheduler: Any,
                 inner_worker: Any, store: Any, held_blocks: Callable[[list[bytes]], int]) -> DisaggHalves:
    """The halves for ``config.role``; ``root``: the engine's root block hash; ``store`` (a
    TieredStore or None) is the shared fallback."""
    worker = DisaggWorker(config, key_space, num_layers, inner=inner_worker, held_blocks=held_blocks,
                          shared_tier=None if store is None else store.get)
    return DisaggHalves(DisaggScheduler(config.role, key_space.block_size, root, inner_scheduler), worker)


def leading_held(count_cached: Callable[[list[bytes]], int], hashes: list[bytes]) -> int:
    """How many leading blocks of ``hashes`` ``count_cached`` finds (it counts any, not leading)."""
    for i, block_hash in enumerate(hashes):
        if count_cached([block_hash]) == 0:
            return i
    return len(hashes)
