"""KVCacheManager: per-request block tables over a BlockPool, with chained-hash prefix caching.

Per request the manager keeps, for request r with blocks b_0..b_{n-1}:

    b_0 .. b_{k-1}     full and computed; registered in the pool's hash map, except a block whose
                       hash another request registered first (it stays private, unhashed)
    b_k .. b_{n-1}     being filled, or full but not yet computed

``cache_full_blocks`` moves k forward after each step, so a block is shareable as soon as the step
that computed it has run, not only when its request ends. ``request.block_hashes`` is extended
only for newly full blocks; no step re-hashes a whole prompt.

Sessions: when a request of a session ends, ``park_session`` moves its blocks (the partial last
block included) and its block hashes into a ``SessionBlocks`` holding instead of freeing them, so
their ref counts keep them out of the free queue. The session's next request takes them back with
``resume_session`` when its prompt starts with the tokens they hold: no hashing, no lookup, only
the new tokens to compute. A request id holds blocks in ``_blocks`` or a session id holds them in
``_sessions``, never both. ``fork_session`` gives a second session its own holding of another's
full blocks (each holding references them; nobody writes into a full block).

Window layers (Gemma): with a ``WindowLayout`` the manager also keeps a ``WindowGroup``, the
window layers' own pool and a second table per request beside ``_blocks``; each call below makes
the same change there, and ``slide_window`` releases what no row still to compute can see.

Retention (``kvhive.kv.retention_policy``): freed blocks take their request's retention
priorities; a spilled session's blocks are pinned until the session ends.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.core.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, BlockUpdated
from kvhive.core.retention import RetentionSpec
from kvhive.kv.held_blocks import HeldChain, held_block_events, stored_runs
from kvhive.kv.pool import BlockPool, BlockPoolStats, KVBlock
from kvhive.kv.retention_policy import SpillPins, at_least_pinned, block_retentions, priority_events
from kvhive.kv.window_group import WindowGroup, WindowLayout
from kvhive.request import Request


class ComputedBlocks(NamedTuple):
    """Result of a prefix lookup: the cached blocks of the longest match and the tokens they cover."""

    blocks: list[KVBlock]
    num_computed_tokens: int      # len(blocks) * block_size


class BlockCopy(NamedTuple):
    """Copy the first ``num_tokens`` token slots of pool block ``src`` into block ``dst`` (every layer)."""

    src: int
    dst: int
    num_tokens: int


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


@dataclass(eq=False)
class SessionBlocks:
    """The blocks a session keeps alive between its requests, and what they hold."""

    token_ids: list[int]             # the session's tokens; KV is in the blocks for the first
    num_computed_tokens: int         # num_computed_tokens of them (the last sampled one has none)
    blocks: list[KVBlock]
    block_hashes: list[bytes]        # chained hashes of the full blocks of token_ids
    num_cached_blocks: int           # leading blocks registered in the pool's hash map
    last_used: int                   # park order, for least-recently-used spilling
    retention: RetentionSpec | None = None   # the parking request's, given to the blocks as they are freed
    num_prompt_tokens: int = 0


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
        self._spill_pins = SpillPins(self.pool)
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
        # Session id -> blocks kept alive between the session's requests (insertion order = LRU).
        self._sessions: dict[str, SessionBlocks] = {}
        # Invariant: _session_block_refs[id] == number of holdings in _sessions whose blocks hold id (> 0).
        self._session_block_refs: Counter[int] = Counter()
        self._park_counter = 0
        # Partial-block hits admitted since the last plan, and their source blocks, referenced
        # until the step that copies them has run (``release_copy_sources``).
        self._copies: list[BlockCopy] = []
        self._copy_sources: list[KVBlock] = []

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

    def partial_hit(self, request: Request, num_hit_blocks: int) -> tuple[KVBlock | None, int]:
        """After ``num_hit_blocks`` full-block hits: the cached block whose leading tokens match the
        most of the request's next block, and how many tokens match (at most the block less one,
        and never the request's last token); (None, 0) when none does.

        That block follows the same chain (the same parent hash, so the same model, salt and
        earlier tokens), so its first tokens' KV is what computing them would give: a finished
        turn's last prompt block, whose later tokens are the reply the next turn's history replaced,
        or the partly filled last block of a finished request (listed as it was freed).
        Off with a window pool (its blocks are not copied) and for a first block (no parent to key on).
        """
        if not self.enable_prefix_caching or self.window is not None or num_hit_blocks == 0:
            return None, 0
        start = num_hit_blocks * self.block_size
        limit = min(self.block_size - 1, request.num_tokens - 1 - start)
        if limit <= 0:
            return None, 0
        block, n = self.pool.longest_child(request.block_hashes[num_hit_blocks - 1],
                                           request.all_token_ids[start:start + limit])
        return (block, n) if n else (None, 0)

    def pin(self, block: KVBlock) -> None:
        """Take a reference on a block (a partial hit's source, while its admission allocates)."""
        self.pool.touch([block])

    def unpin(self, block: KVBlock) -> None:
        """Drop a reference ``pin`` took."""
        self.pool.free_blocks([block])

    def take_partial_hit(self, request: Request, num_hit_blocks: int, source: KVBlock, num_tokens: int) -> None:
        """Plan the copy of a pinned partial hit into the request's block after its full hits
        (allocated already); the source stays referenced until ``release_copy_sources``."""
        dst = self.get_block_table(request)[num_hit_blocks]
        self._copies.append(BlockCopy(source.block_id, dst, num_tokens))
        self._copy_sources.append(source)
        if request.num_cached_tokens < 0:
            self._hits_tokens += num_tokens

    def take_block_copies(self) -> tuple[BlockCopy, ...]:
        """The block copies planned since the last call (for the next plan)."""
        copies, self._copies = tuple(self._copies), []
        return copies

    def release_copy_sources(self) -> None:
        """Drop the references on the sources of copies a step has run."""
        if self._copy_sources:
            self.pool.free_blocks(self._copy_sources)
            self._copy_sources = []

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

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        self._events += stored_runs(request.block_hashes, request.all_token_ids, indices, self.block_size)

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first, so a cached chain's end is evicted first."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self._list_partial(blocks, request.block_hashes, request.all_token_ids, request.num_computed_tokens)
            kept = block_retentions(request.retention, len(blocks), self.block_size, request.num_tokens,
                                    request.num_prompt_tokens)
            self.pool.free_blocks(reversed(blocks), reversed(kept))
        if self.window is not None:
            self.window.free(rid)
        if request.end_session and request.session_id is not None:
            self._spill_pins.withdraw(request.session_id)

    def _list_partial(self, blocks: list[KVBlock], block_hashes: Sequence[bytes], token_ids: Sequence[int],
                      num_computed: int) -> None:
        """Before its last holder frees it, list the partly computed block after the full ones
        under its parent, with its computed tokens (see ``partial_hit``)."""
        if not self.enable_prefix_caching or self.window is not None:
            return
        num_full, rest = divmod(num_computed, self.block_size)
        if not rest or not num_full or num_full >= len(blocks) or len(block_hashes) < num_full:
            return
        block = blocks[num_full]
        if block.ref_cnt == 1 and block.block_hash is None and block.parent_hash is None:
            self.pool.list_partial(block, block_hashes[num_full - 1], token_ids[num_full * self.block_size:num_computed])

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
        chains += [HeldChain(h.blocks, h.block_hashes, h.token_ids) for h in self._sessions.values()]
        return DeviceReset(dropped, len(self.pool.cached), held_block_events(chains, self.block_size))

    # ------------------------------------------------------------------ sessions

    def park_session(self, request: Request, session_id: str) -> None:
        """Move a finished request's blocks into the session's holding (replacing an older one)."""
        self.release_session(session_id)
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        num_cached = self._num_cached_blocks.pop(rid, 0)
        if self.window is not None and blocks:
            self.window.move(rid, ("session", session_id))
        elif self.window is not None:
            self.window.free(rid)
        if not blocks:
            return
        self._park_counter += 1
        self._sessions[session_id] = SessionBlocks(
            token_ids=request.all_token_ids, num_computed_tokens=request.num_computed_tokens,
            blocks=blocks, block_hashes=request.block_hashes, num_cached_blocks=num_cached,
            last_used=self._park_counter, retention=request.retention,
            num_prompt_tokens=request.num_prompt_tokens)
        self._session_block_refs.update(block.block_id for block in blocks)

    def session_prefix(self, request: Request) -> int:
        """Tokens of the request's session KV that its prompt continues (0: none held, or diverged).

        A token comparison only (C speed), never a hash: the holding's tokens must all be a prefix
        of the request's, so its KV covers ``num_computed_tokens`` of them and at least one token
        is left to compute.
        """
        held = self._sessions.get(request.session_id) if request.session_id else None
        if held is None or held.num_computed_tokens == 0:
            return 0
        n = len(held.token_ids)
        if n >= request.num_tokens or request.all_token_ids[:n] != held.token_ids:
            return 0
        return held.num_computed_tokens

    def resume_session(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request its session's blocks plus room for ``num_new_tokens``; False if short.

        Call only when ``session_prefix`` is > 0. On success the holding is gone, the request's
        ``num_computed_tokens`` and ``block_hashes`` are the session's, and the prefix-cache
        counters count the held tokens as hits. On failure nothing changed.
        """
        held = self._sessions[request.session_id]
        computed = held.num_computed_tokens
        keep = self.num_blocks_for(computed)
        extra = max(0, self.num_blocks_for(computed + num_new_tokens) - keep)
        spare = len(held.blocks) - keep
        if extra > self.pool.num_free_blocks + spare:
            return False
        if self.window is not None and not self.window.room_to_resume(("session", request.session_id), keep,
                                                                      keep + extra):
            return False
        self._take_holding(request.session_id)
        rid = request.request_id
        blocks = held.blocks[:keep]
        if spare > 0:
            self.pool.free_blocks(reversed(held.blocks[keep:]))
        if self.window is not None:
            self.window.move(("session", request.session_id), rid)
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

    def fork_session(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give ``child_id`` its own holding of the parent's full blocks within its first
        ``num_tokens`` tokens (replacing an older one); the tokens shared (0: the parent holds no
        full block of them, or window layers are in use).

        Copy-on-write by construction: a shared block is full and computed, and neither side ever
        writes into a full block; each side's next request writes from its own end on, into blocks
        of its own (the partial last block is never shared). Each holding takes a reference on
        every shared block, so either side's release leaves the other's.
        """
        held = self._sessions.get(parent_id)
        if held is None or self.window is not None or parent_id == child_id:
            return 0
        num_full = min(num_tokens, held.num_computed_tokens) // self.block_size
        num_full = min(num_full, len(held.blocks))
        if self.enable_prefix_caching:            # without it, blocks are not hashed (tokens match them)
            num_full = min(num_full, len(held.block_hashes))
        self.release_session(child_id)
        if num_full == 0:
            return 0
        blocks = held.blocks[:num_full]
        self.pool.touch(blocks)
        self._park_counter += 1
        num_shared = num_full * self.block_size
        self._sessions[child_id] = SessionBlocks(
            token_ids=held.token_ids[:num_shared], num_computed_tokens=num_shared, blocks=blocks,
            block_hashes=held.block_hashes[:num_full], num_cached_blocks=min(held.num_cached_blocks, num_full),
            last_used=self._park_counter, retention=held.retention,
            num_prompt_tokens=min(held.num_prompt_tokens, num_shared))
        self._session_block_refs.update(block.block_id for block in blocks)
        return num_shared

    def release_session(self, session_id: str, spill: bool = False) -> bool:
        """Free the blocks a session holds, tail first (full ones stay cached), with the parking
        request's retention; ``spill`` (memory pressure, the session lives on): at least pinned
        until the session ends. False if none."""
        held = self._take_holding(session_id)
        if held is None:
            return False
        self._list_partial(held.blocks, held.block_hashes, held.token_ids, held.num_computed_tokens)
        kept = block_retentions(held.retention, len(held.blocks), self.block_size, len(held.token_ids),
                                held.num_prompt_tokens)
        self.pool.free_blocks(reversed(held.blocks), reversed(at_least_pinned(kept) if spill else kept))
        if spill:
            self._spill_pins.record(session_id, held.blocks)
        if self.window is not None:
            self.window.free(("session", session_id))
        return True

    def end_session(self, session_id: str) -> bool:
        """The session ended: free its holding and withdraw the pins of its spilled blocks."""
        released = self.release_session(session_id)
        self._spill_pins.withdraw(session_id)
        return released

    def _take_holding(self, session_id: str) -> SessionBlocks | None:
        """Remove and return the session's holding (its blocks keep their references)."""
        held = self._sessions.pop(session_id, None)
        if held is not None:
            refs = self._session_block_refs
            for block in held.blocks:
                refs[block.block_id] -= 1
                if refs[block.block_id] == 0:
                    del refs[block.block_id]
        return held

    def session_ids(self) -> list[str]:
        """Sessions holding device blocks, least recently parked first."""
        return sorted(self._sessions, key=lambda sid: self._sessions[sid].last_used)

    def session_blocks(self, session_id: str) -> SessionBlocks | None:
        """The holding of a session, or None (read-only view)."""
        return self._sessions.get(session_id)

    @property
    def num_session_blocks(self) -> int:
        """Distinct device blocks held by sessions (a block two sessions share counts once)."""
        return len(self._session_block_refs)

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
