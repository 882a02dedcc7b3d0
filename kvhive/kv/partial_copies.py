"""Partial-block reuse: a prompt's next block copied from a cached sibling that shares its first tokens.

After a prompt's full-block hits, the pool may hold a block under the same parent hash whose
leading tokens match the prompt's next ones (``BlockPool.longest_child``): a finished turn's last
prompt block, or a request's partly filled last block, listed as it was freed (``list_partial``).
Its first slots hold the KV computing those tokens would give, so the scheduler plans a copy
(``BlockCopy``) into the request's own block instead. The source is referenced from the moment
it is picked (``pin``) until the step that copies it has run (``release_sources``).

Off without prefix caching and with a window pool (its blocks are not copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvhive.kv.pool import BlockPool, KVBlock
from kvhive.request import Request


class BlockCopy(NamedTuple):
    """Copy the first ``num_tokens`` token slots of pool block ``src`` into block ``dst`` (every layer)."""

    src: int
    dst: int
    num_tokens: int


class PartialHit(NamedTuple):
    """The cached block whose leading tokens match a prompt's next block, and how many match."""

    block: KVBlock | None         # None: no block matches
    num_tokens: int               # 0 when block is None


NO_PARTIAL_HIT = PartialHit(None, 0)


class PartialCopies:
    """Finds partial-block hits, lists partly computed blocks as they are freed, and keeps the
    copies planned since the last plan with their referenced sources."""

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        """``enabled``: prefix caching on and no window pool."""
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        # Partial-block hits admitted since the last plan, and their source blocks, referenced
        # until the step that copies them has run (``release_sources``).
        self._copies: list[BlockCopy] = []
        self._sources: list[KVBlock] = []

    def find(self, request: Request, num_hit_blocks: int) -> PartialHit:
        """After ``num_hit_blocks`` full-block hits: the cached block whose leading tokens match the
        most of the request's next block, and how many tokens match (at most the block less one,
        and never the request's last token); ``NO_PARTIAL_HIT`` when none does.

        That block follows the same chain (the same parent hash, so the same model, salt and
        earlier tokens), so its first tokens' KV is what computing them would give. Off for a
        first block (no parent to key on). Changes nothing.
        """
        if not self.enabled or num_hit_blocks == 0:
            return NO_PARTIAL_HIT
        start = num_hit_blocks * self.block_size
        limit = min(self.block_size - 1, request.num_tokens - 1 - start)
        if limit <= 0:
            return NO_PARTIAL_HIT
        block, n = self.pool.longest_child(request.block_hashes[num_hit_blocks - 1],
                                           request.all_token_ids[start:start + limit])
        return PartialHit(block, n) if n else NO_PARTIAL_HIT

    def list_partial(self, blocks: list[KVBlock], block_hashes: Sequence[bytes], token_ids: Sequence[int],
                     num_computed: int) -> None:
        """Before its last holder frees it, list the partly computed block after the full ones
        under its parent, with its computed tokens (a source for ``find``)."""
        if not self.enabled:
            return
        num_full, rest = divmod(num_computed, self.block_size)
        if not rest or not num_full or num_full >= len(blocks) or len(block_hashes) < num_full:
            return
        block = blocks[num_full]
        if block.ref_cnt == 1 and block.block_hash is None and block.parent_hash is None:
            self.pool.list_partial(block, block_hashes[num_full - 1], token_ids[num_full * self.block_size:num_computed])

    def pin(self, block: KVBlock) -> None:
        """Take a reference on a block (a partial hit's source, while its admission allocates)."""
        self.pool.touch([block])

    def unpin(self, block: KVBlock) -> None:
        """Drop a reference ``pin`` took."""
        self.pool.free_blocks([block])

    def plan(self, source: KVBlock, dst: int, num_tokens: int) -> None:
        """Plan the copy of a pinned source's first ``num_tokens`` slots into block ``dst``; the
        source stays referenced until ``release_sources``."""
        self._copies.append(BlockCopy(source.block_id, dst, num_tokens))
        self._sources.append(source)

    def take(self) -> tuple[BlockCopy, ...]:
        """The block copies planned since the last call (for the next plan)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def release_sources(self) -> None:
        """Drop the references on the sources of copies a step has run."""
        if self._sources:
            self.pool.free_blocks(self._sources)
            self._sources = []
