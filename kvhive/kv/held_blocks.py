"""The device blocks a replica holds, as ``BlockStored`` events (torch-free).

After a prefix-cache reset the KV-event stream says ``AllBlocksCleared`` and then states again every
block the replica still holds; the device pool's part is built here. A holder (a running request,
a session's holding) is a chain: its blocks, their chained hashes and its tokens. Each block
registered in the pool's hash map is announced once, in its holder's order, with its parent and
token ids as ``KVCacheManager`` announces a newly cached block, so a consumer that recomputes keys
from token ids (the gateway for ``int64`` hashes, llm-d) can follow every chain again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvhive.core.kv_events import MEDIUM_GPU, BlockStored
from kvhive.kv.pool import KVBlock


class HeldChain(NamedTuple):
    """One holder's blocks in order, the chained hashes of its full blocks, and its tokens."""

    blocks: Sequence[KVBlock]
    block_hashes: Sequence[bytes]
    token_ids: Sequence[int]


def stored_runs(block_hashes: Sequence[bytes], token_ids: Sequence[int], indices: Sequence[int],
                block_size: int) -> list[BlockStored]:
    """One device ``BlockStored`` per run of consecutive block indices (ascending), as vLLM emits
    them: each names the hash before the run as its parent and carries the run's tokens."""
    events: list[BlockStored] = []
    run_start = 0
    for j, i in enumerate(indices):
        if j == 0 or indices[j - 1] != i - 1:
            run_start = i
        if j + 1 < len(indices) and indices[j + 1] == i + 1:
            continue
        events.append(BlockStored(
            block_hashes=list(block_hashes[run_start:i + 1]),
            parent_block_hash=block_hashes[run_start - 1] if run_start > 0 else None,
            token_ids=list(token_ids[run_start * block_size:(i + 1) * block_size]),
            block_size=block_size, medium=MEDIUM_GPU))
    return events


def held_block_events(chains: Iterable[HeldChain], block_size: int) -> list[BlockStored]:
    """``BlockStored`` events for the registered blocks of ``chains``, each block once.

    A block is announced by the first chain that holds it under its own hash; a block a chain holds
    privately (another block registered the same hash first) has no hash and is skipped.
    """
    announced: set[int] = set()
    events: list[BlockStored] = []
    for chain in chains:
        num_full = min(len(chain.blocks), len(chain.block_hashes), len(chain.token_ids) // block_size)
        indices = [i for i in range(num_full)
                   if chain.blocks[i].block_hash == chain.block_hashes[i]
                   and chain.blocks[i].block_id not in announced]
        announced.update(chain.blocks[i].block_id for i in indices)
        events += stored_runs(chain.block_hashes, chain.token_ids, indices, block_size)
    return events
