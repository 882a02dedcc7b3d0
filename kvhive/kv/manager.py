"""KVCacheManager: per-request block tables over a BlockPool, with chained-hash prefix caching.

Per request the manager keeps, for request r with blocks b_0..b_{n-1}:

    b_0 .. b_{k-1}     full and computed; registered in the pool's hash map, except a block whose
                       hash another request registered first (it stays private, unhashed)
    b_k .. b_{n-1}     being filled, or full but not yet computed

``cache_full_blocks`` moves k forward after each step, so a block is shareable as soon as the step
that computed it has run, not only when its request ends. ``request.block_hashes`` is extended
only for newly full blocks; no step re-hashes a whole prompt.

The manager composes two parts of its own, public like ``pool``, and moves blocks between them
and the request tables:

- ``sessions`` (``kvhive.kv.session_holdings``): the blocks a session keeps between its requests,
  looked up, forked and released there; ``park_session`` moves a finished request's blocks into a
  holding, ``resume_session`` gives them back to the session's next request.
- ``copies`` (``kvhive.kv.partial_copies``): a prompt's next block copied from a cached sibling
  that shares its leading tokens, found and pinned there; ``take_partial_hit`` plans the copy
  into the request's block, run by the next step.

Window layers (Gemma): with a ``WindowLayout`` the manager also keeps a ``WindowGroup``, the
window layers' own pool and a second table per request beside ``_blocks``; each call below makes
the same change there, and ``slide_window`` releases what no row still to compute can see.

Retention (``kvhive.kv.retention_policy``): freed blocks take their request's retention
priorities; a spilled session's blocks are pinned until the session ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.core.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, BlockUpdated
from kvhive.kv.held_blocks import HeldChain, held_block_events, stored_runs
from kvhive.kv.partial_copies import PartialCopies
from kvhive.kv.pool import BlockPool, BlockPoolStats, KVBlock
from kvhive.kv.retention_policy import block_retentions, priority_events
from kvhive.kv.session_holdings import SessionBlocks, SessionHoldings, window_key
from kvhive.kv.window_group import WindowGroup, WindowLayout
from kvhive.request import Request


class ComputedBlocks(NamedTuple):
    """Result of a prefix lookup: the cached blocks of the longest match and the tokens they cover."""

    blocks: list[KVBlock]
    num_computed_tokens: int      # len(blocks) * block_size


@dataclass(frozen=True)
class KVCacheStats:
    """KV usage and prefix-cache counters (tokens) for metrics."""

    usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    blocks: BlockPoolStats
    window: BlockPoolStats | None = None     # the window layers' pool (kvhive.kv.window_group); None: none


class DeviceReset(NamedTuple):
    """What a prefix-cache reset did to the device pool, and what the pool still holds."""

    num_dropped: int              # cached blocks nobody held: forgotten
    num_kept: int                 # cached blocks running requests or sessions hold
    stored: list[BlockStored]     # the kept blocks, to announce after AllBlocksCleared


class KVCacheManager:
    """Allocates, caches and frees the blocks of requests; matches prompts against cached blocks."""

    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool, root_hash: bytes,
                 window: WindowLayout | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``window``: the window layers' own pool and its layout; None (every layer in one pool).
        ``clock``: monotonic seconds, for retention durations."""
        self.block_size = block_size
        self.window = WindowGroup(block_size, window) if window is not None else None
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash
        self.pool = BlockPool(num_blocks, clock)
        self.copies = PartialCopies(self.pool, block_size, enable_prefix_caching and self.window is None)
        self.sessions = SessionHoldings(self.pool, block_size, enable_prefix_caching, self.window, self.copies)
        self._blocks: dict[str, list[KVBlock]] = {}
        # Block ids handed out as block tables: replaced (never mutated) when blocks are added, so
        # a decode step that adds no block shares the previous step's list instead of copying it.
        self._block_ids: dict[str, list[int]] = {}
        # Leading blocks of each request that are registered in the pool's hash map.
        self._num_cached_blocks: dict[str, int] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0
        # KV events since the last take_events(); None until enable_events() is called.
        self._events: list[BlockStored | BlockRemoved | BlockUpdated] | None = None

    def enable_events(self, priority_events: bool = False) -> None:
        """Start recording BlockStored / BlockRemoved events for take_events(); with
        ``priority_events``, BlockUpdated too (retention priority changes)."""
        self._events = []
        self.pool.evicted_hashes = []
        if priority_events:
            self.pool.priority_changes = []

    def take_events(self) -> list[BlockStored | BlockRemoved | BlockUpdated]:
        """Events since the last call, evictions first (the order the pool saw them), priority
        changes of blocks still cached last (retentions that ended are let go first)."""
        if self._events is None:
            return []
        self.pool.expire()
        out: list[BlockStored | BlockRemoved | BlockUpdated] = []
        if self.pool.evicted_hashes:
            out.append(BlockRemoved(block_hashes=self.pool.evicted_hashes, medium=MEDIUM_GPU))
            self.pool.evicted_hashes = []
        out += self._events
        self._events = []
        if self.pool.priority_changes:
            out += priority_events(self.pool.priority_changes, self.pool.cached)
            self.pool.priority_changes = []
        return out

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a single request could hold at most (the null block aside)."""
        return self.pool.num_blocks - 1

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute.

        Pure lookup: takes no references (``allocate_slots`` does) and counts nothing.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        self._update_block_hashes(request)
        # At most (num_tokens - 1) tokens, rounded down to a block: the last token is always
        # computed so that the step produces logits to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.window is not None:         # usable only where the last window's window parts are kept
            hits = hits[:self.window.usable_hit(request.block_hashes, len(hits))]
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def take_partial_hit(self, request: Request, num_hit_blocks: int, source: KVBlock, num_tokens: int) -> None:
        """Plan the copy of a pinned partial hit into the request's block after its full hits
        (allocated already); the source stays referenced until ``copies.release_sources``."""
        self.copies.plan(source, self.get_block_table(request)[num_hit_blocks], num_tokens)
        if request.num_cached_tokens < 0:
            self._hits_tokens += num_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (), num_loaded_tokens: int = 0) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens; False (nothing changed) if short.

        ``new_computed_blocks`` (admission only) are prefix hits not yet counted in
        ``request.num_computed_tokens``; they are referenced and put first in the block table.
        Room is needed for request.num_computed_tokens + hits + num_new_tokens tokens.
        ``num_loaded_tokens`` (admission only, part of ``num_new_tokens``): the first new tokens,
        which a KV connector loads (whole blocks from a tier; a transfer's may end mid-block);
        their window entries are null where no row after them sees them.
        """
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if new_computed_blocks and blocks:
            raise ValueError(f"request {rid}: prefix hits are only taken at admission")
        num_held = len(blocks) if blocks else 0
        num_hits = len(new_computed_blocks)
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(total) - num_held - num_hits
        # Touching an evictable hit takes it out of the free queue, so it cannot also be a new block.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return False
        num_loaded = num_loaded_tokens // self.block_size
        if self.window is not None and not self.window.can_grow(
                rid, [b.block_hash for b in new_computed_blocks], num_held + num_hits + max(num_new_blocks, 0),
                num_loaded):
            return False
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._num_cached_blocks[rid] = 0
            if self.enable_prefix_caching and request.num_cached_tokens < 0:
                # First admission: count the query once, whatever retries or preemptions follow.
                self._queries_tokens += request.num_tokens
                self._hits_tokens += num_hits * self.block_size
        added: list[KVBlock] = []
        if num_hits:
            self.pool.touch(new_computed_blocks)
            added.extend(new_computed_blocks)
            self._num_cached_blocks[rid] = num_hits
        if num_new_blocks > 0:
            added.extend(self.pool.get_new_blocks(num_new_blocks))
        if added or rid not in self._block_ids:
            blocks.extend(added)
            # Copy on growth only (a C-level concat); plans already handed out keep their lists.
            self._block_ids[rid] = self._block_ids.get(rid, []) + [b.block_id for b in added]
        if self.window is not None:
            self.window.grow(rid, [b.block_hash for b in new_computed_blocks], len(blocks), num_loaded)
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Register the request's blocks that are full within its first ``num_tokens`` computed tokens.

        Call after the step that computed (or loaded) them has run. Returns the indices, in the
        request's block table, of the blocks newly registered. A block whose hash another request
        registered first stays unhashed (the pool keeps one block per hash).
        """
        if not self.enable_prefix_caching:
            return []
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is None:
            return []
        start = self._num_cached_blocks[rid]
        num_full = min(num_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return []
        self._update_block_hashes(request)
        hashes, tokens, B = request.block_hashes, request.all_token_ids, self.block_size
        # Listed under its parent (see partial_hit); a first block has none.
        stored = [i for i in range(start, num_full) if self.pool.cache_block(
            blocks[i], hashes[i], hashes[i - 1] if i else None, tokens[i * B:(i + 1) * B])]
        if self.window is not None:
            self.window.cache(rid, hashes, start, num_full)
        self._num_cached_blocks[rid] = num_full
        if self._events is not None and stored:
            self._record_stored(request, stored)
        return stored

    def trim_blocks(self, request: Request, num_tokens: int) -> int:
        """Free the request's tail blocks past the first ``num_tokens`` tokens (blocks allocated
        for draft tokens that were rejected: never hashed), in both pools; returns how many main
        blocks. The window's slide is not undone: it only ever released blocks no row at
        ``num_tokens`` or later can see."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        keep = self.num_blocks_for(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        if keep < self._num_cached_blocks[rid]:
            raise ValueError(f"request {rid}: cannot trim its blocks to {num_tokens} tokens")
        extra = blocks[keep:]
        del blocks[keep:]
        self._block_ids[rid] = self._block_ids[rid][:keep]
        self.pool.free_blocks(reversed(extra))
        if self.window is not None:
            self.window.free(rid, keep)
        return len(extra)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        self._events += stored_runs(request.block_hashes, request.all_token_ids, indices, self.block_size)

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first, so a cached chain's end is evicted first."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self.copies.list_partial(blocks, request.block_hashes, request.all_token_ids, request.num_computed_tokens)
            kept = block_retentions(request.retention, len(blocks), self.block_size, request.num_tokens,
                                    request.num_prompt_tokens)
            self.pool.free_blocks(reversed(blocks), reversed(kept))
        if self.window is not None:
            self.window.free(rid)
        if request.end_session and request.session_id is not None:
            self.sessions.withdraw_spill_pins(request.session_id)

    def slide_window(self, request: Request) -> int:
        """Release the window blocks no row of the request still to compute can see; returns how many."""
        return 0 if self.window is None else self.window.slide(request.request_id, request.num_computed_tokens)

    def has_window_context(self, request: Request, next_pos: int) -> bool:
        """Whether the request holds the window parts a row at ``next_pos`` sees (always without a window pool)."""
        return self.window is None or self.window.has_context(request.request_id, next_pos)

    def reset_prefix_cache(self, requests: Mapping[str, Request]) -> DeviceReset:
        """Forget every cached block nobody holds; list the blocks held by ``requests`` (every
        unfinished request, and finished ones whose blocks a transfer still holds) and sessions.

        Pending events are dropped: the caller announces AllBlocksCleared, then ``stored``.
        """
        self.take_events()
        dropped = self.pool.reset_prefix_cache()
        if self.window is not None:
            self.window.pool.reset_prefix_cache()
        chains = [HeldChain(self._blocks[rid], r.block_hashes, r.all_token_ids)
                  for rid, r in requests.items() if rid in self._blocks]
        chains += [HeldChain(h.blocks, h.block_hashes, h.token_ids) for h in self.sessions.values()]
        return DeviceReset(dropped, len(self.pool.cached), held_block_events(chains, self.block_size))

    # ------------------------------------------------------------------ sessions

    def park_session(self, request: Request, session_id: str) -> None:
        """Move a finished request's blocks into the session's holding (replacing an older one)."""
        self.sessions.release(session_id)
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        num_cached = self._num_cached_blocks.pop(rid, 0)
        if self.window is not None and blocks:
            self.window.move(rid, window_key(session_id))
        elif self.window is not None:
            self.window.free(rid)
        if not blocks:
            return
        self.sessions.put(session_id, SessionBlocks(
            token_ids=request.all_token_ids, num_computed_tokens=request.num_computed_tokens,
            blocks=blocks, block_hashes=request.block_hashes, num_cached_blocks=num_cached,
            retention=request.retention, num_prompt_tokens=request.num_prompt_tokens))

    def resume_session(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request its session's blocks plus room for ``num_new_tokens``; False if short.

        Call only when ``sessions.prefix_of`` is > 0. On success the holding is gone, the request's
        ``num_computed_tokens`` and ``block_hashes`` are the session's, and the prefix-cache
        counters count the held tokens as hits. On failure nothing changed.
        """
        session_id = request.session_id
        held = self.sessions.get(session_id)
        computed = held.num_computed_tokens
        keep = self.num_blocks_for(computed)
        extra = max(0, self.num_blocks_for(computed + num_new_tokens) - keep)
        spare = len(held.blocks) - keep
        if extra > self.pool.num_free_blocks + spare:
            return False
        if self.window is not None and not self.window.room_to_resume(window_key(session_id), keep, keep + extra):
            return False
        self.sessions.take(session_id)
        rid = request.request_id
        blocks = held.blocks[:keep]
        if spare > 0:
            self.pool.free_blocks(reversed(held.blocks[keep:]))
        if self.window is not None:
            self.window.move(window_key(session_id), rid)
            self.window.free(rid, keep)
        self._blocks[rid] = blocks
        self._block_ids[rid] = [b.block_id for b in blocks]
        num_full = computed // self.block_size
        self._num_cached_blocks[rid] = min(held.num_cached_blocks, num_full)
        request.block_hashes = held.block_hashes[:num_full]
        request.num_computed_tokens = computed
        if request.num_cached_tokens < 0 and self.enable_prefix_caching:
            self._queries_tokens += request.num_tokens
            self._hits_tokens += computed
        ok = self.allocate_slots(request, num_new_tokens)
        assert ok, "resume_session checked the free blocks"
        return True

    # ------------------------------------------------------------------ lookups
    def count_cached(self, block_hashes: Sequence[bytes]) -> int:
        """How many of these blocks the device prefix cache holds; changes nothing, not even
        recency (safe from any thread: the hash map is only read)."""
        cached = self.pool.cached
        return sum(1 for h in block_hashes if h in cached)

    def get_block_table(self, request: Request) -> list[int]:
        """The request's block ids in order (shared, treat as read-only; a new list when it grows)."""
        return self._block_ids.get(request.request_id, [])

    def get_window_table(self, request: Request) -> list[int] | None:
        """The request's window-pool block ids (0 where released), or None without a window pool."""
        return None if self.window is None else self.window.table(request.request_id)

    def stats(self) -> KVCacheStats:
        """Usage and prefix-cache counters."""
        pool = self.pool.stats()
        return KVCacheStats(usage=pool.usage, prefix_cache_queries_tokens=self._queries_tokens,
                            prefix_cache_hits_tokens=self._hits_tokens, blocks=pool,
                            window=None if self.window is None else self.window.stats())

    def _update_block_hashes(self, request: Request) -> None:
        # Extends request.block_hashes to cover every full block of all_token_ids; hashes only the
        # new blocks, chained from the last known hash.
        hashes = request.block_hashes
        k = len(hashes)
        if (k + 1) * self.block_size > request.num_tokens:
            return
        if k == 0:
            hashes.extend(hash_blocks(request.all_token_ids, self.block_size, self.root_hash,
                                      ExtraKeys(cache_salt=request.cache_salt)))
        else:
            hashes.extend(hash_blocks(request.all_token_ids, self.block_size, self.root_hash,
                                      start_block=k, parent=hashes[k - 1]))
