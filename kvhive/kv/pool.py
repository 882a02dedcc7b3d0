"""BlockPool: the device KV blocks, their ref counts, the prefix-cache map and the free queue.

Every block is in exactly one of three states (torch-free, pure bookkeeping):

    state       ref_cnt  hash or listing  in free queue
    empty       0        neither          yes
    evictable   0        either           yes      (reusable, evicted on demand)
    used        > 0      any              no

so empty + evictable + used == num_blocks (block 0 aside, see ``NULL_BLOCK_ID``). A block is in
the hash map (``cached``) iff it has a hash.

A cached block registered with its parent's hash and its tokens is also listed under that parent
(``children``), so a prompt whose next block is not cached can still reuse the leading tokens a
cached sibling shares with it (``longest_child``; ``kvhive.kv.partial_copies``). A
request's last, partly filled block gets such a listing, and no hash, as it is freed
(``list_partial``).

Eviction order (``kvhive.kv.free_queue``): empty blocks first, then evictable blocks of the
lowest retention priority, least recently freed first within a priority. A block's priority is
given as its holders free it (``free_blocks(blocks, retentions)``, see ``kvhive.core.retention``):
the stronger of its live retention and the freer's (higher priority; among equals the later
expiry), so a one-off request hitting a pinned prefix never demotes it. A block handed out again
starts with no retention (``retained`` False, the default priority). A retention with a duration
falls back to the default priority when it ends: expiries sit in a heap checked on each
allocation (``expire``), and an expired evictable block goes to the head of the default level
(it was freed before every block there). With every block at the default priority the order is
plain LRU.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvhive.core.retention import DEFAULT_PRIORITY, DEFAULT_RETENTION, BlockRetention
from kvhive.kv.free_queue import FreeBlockQueue, PriorityFreeQueue

__all__ = ["MAX_SIBLINGS_SCANNED", "NULL_BLOCK_ID", "BlockPool", "BlockPoolStats", "FreeBlockQueue", "KVBlock",
           "PriorityChange", "is_reusable"]

# Block 0 is never handed out: the runner may point padding slots at it (CUDA-graph padding,
# dummy positions). It is in no queue and no map.
NULL_BLOCK_ID = 0
# Siblings ``BlockPool.longest_child`` compares a prompt's next block with, most recent first.
MAX_SIBLINGS_SCANNED = 32


@dataclass(eq=False, slots=True)
class KVBlock:
    """One pool block: id, ref count, hash when full and cached, and free-queue links."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # Set with block_hash when the block is listed under its parent (see BlockPool.children).
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    # Retention (kvhive.core.retention): the free-queue level of an evictable block. ``retained``:
    # a holder gave it one since it was last handed out (else the default priority, no expiry).
    priority: int = DEFAULT_PRIORITY
    # Monotonic time at which ``priority`` falls back to the default; None: never.
    expiry: float | None = None
    retained: bool = False
    # Intrusive links; meaningful only while the block is in the free queue.
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}, priority={self.priority})"


@dataclass(frozen=True, slots=True)
class PriorityChange:
    """A cached block's retention priority changed (for KV events)."""

    block_hash: bytes
    old_priority: int
    new_priority: int


@dataclass(frozen=True)
class BlockPoolStats:
    """A snapshot of the pool; counts exclude the null block."""

    num_blocks: int        # allocatable blocks (num_blocks - 1)
    num_free: int          # ref_cnt == 0: empty + evictable
    num_cached: int        # blocks in the hash map (used or evictable)
    num_used: int          # ref_cnt > 0
    usage: float           # num_used / num_blocks
    num_evictable: int = 0  # ref_cnt == 0 with a hash: cached prefixes nobody holds (num_free - empty)


class BlockPool:
    """Ref-counted KV blocks with a hash -> block prefix cache and a priority-then-LRU free queue."""

    def __init__(self, num_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: monotonic seconds, for retention expiries (tests pass their own)."""
        if num_blocks < 2:
            raise ValueError(f"BlockPool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        # Invariant: ref_cnt == 0 <=> the block is in free_queue (the null block excepted).
        self.free_queue = PriorityFreeQueue(self.blocks[1:], is_reusable)
        # Invariant: cached[h] is b <=> b.block_hash == h; one block per hash.
        self.cached: dict[bytes, KVBlock] = {}
        # Hashes evicted since the last drain, for BlockRemoved events; None when nobody listens.
        self.evicted_hashes: list[bytes] | None = None
        # Invariant: the number of blocks with ref_cnt == 0 and a hash (evictable), kept in O(1).
        self._num_evictable = 0
        # Parent hash -> {block id: block} of the cached blocks registered with that parent, oldest
        # first. Invariant: b in children[p].values() <=> b is cached and b.parent_hash == p.
        self.children: dict[bytes, dict[int, KVBlock]] = {}
        self.clock = clock
        # (expiry, block id, block) for every block with an expiry; stale entries (the block's
        # expiry changed since) are skipped when they come up and compacted away when they pile up.
        # Retentions ending at the same time fall back in block id order.
        self._expiries: list[tuple[float, int, KVBlock]] = []
        # Priority changes of cached blocks since the last drain, for KV events; None: nobody listens.
        self.priority_changes: list[PriorityChange] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that get_new_blocks can hand out (empty + evictable)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block holding ``block_hash``, used or evictable; None on a miss. Changes nothing."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the queue head with ref_cnt 1, evicting any cached ones taken."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} free")
        self.expire()
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if is_reusable(block):
                # Evict: the block's contents are about to be overwritten.
                self._num_evictable -= 1
                if self.evicted_hashes is not None and block.block_hash is not None:
                    self.evicted_hashes.append(block.block_hash)
                self._forget(block)
            _clear_retention(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block, reviving evictable ones out of the queue in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if is_reusable(block):
                    self._num_evictable -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock], retentions: Iterable[BlockRetention] | None = None) -> None:
        """Drop one reference on each block; blocks reaching 0 return to the free queue.

        ``blocks`` come in eviction order: among the cached ones of one priority, the first given
        is evicted first (the manager passes a request's blocks tail first). Blocks without a hash
        or a listing hold nothing reusable and go to the head, so they are handed out before any
        cached block. ``retentions`` (one per block): what the freer keeps each reusable block
        with, combined with its live retention (the stronger wins); None: no opinion, the blocks
        keep theirs.
        """
        now = None
        pairs = zip(blocks, retentions, strict=True) if retentions is not None else ((b, None) for b in blocks)
        for block, retention in pairs:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            if retention is not None and is_reusable(block):
                now = self.clock() if now is None else now
                self._retain(block, retention, now)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.push(block)
                if is_reusable(block):
                    self._num_evictable += 1

    def _retain(self, block: KVBlock, retention: BlockRetention, now: float) -> None:
        """Give a held block the stronger of its live retention and ``retention`` (from ``now``)."""
        priority = retention.priority
        expiry = None if retention.duration_s is None or priority == DEFAULT_PRIORITY else now + retention.duration_s
        if block.retained and (block.expiry is None or block.expiry > now):
            if block.priority > priority or (block.priority == priority and (
                    block.expiry is None or (expiry is not None and block.expiry >= expiry))):
                return
        self._set_retention(block, priority, expiry)

    def _set_retention(self, block: KVBlock, priority: int, expiry: float | None) -> None:
        """Set a block's retention (not while it is queued); record a priority change of a cached block."""
        if priority != block.priority and block.block_hash is not None and self.priority_changes is not None:
            self.priority_changes.append(PriorityChange(block.block_hash, block.priority, priority))
        block.priority, block.expiry, block.retained = priority, expiry, True
        if expiry is not None:
            heapq.heappush(self._expiries, (expiry, block.block_id, block))
            if len(self._expiries) > 2 * self.num_blocks + 64:
                self._expiries = [(b.expiry, b.block_id, b) for b in self.blocks if b.expiry is not None]
                heapq.heapify(self._expiries)

    def expire(self) -> int:
        """Let every retention whose duration ended fall back to the default priority; an evictable
        block moves to the head of the default level. Returns how many fell back."""
        if not self._expiries or self._expiries[0][0] > self.clock():
            return 0
        now, n = self.clock(), 0
        while self._expiries and self._expiries[0][0] <= now:
            expiry, _, block = heapq.heappop(self._expiries)
            if block.expiry != expiry:
                continue                      # stale: the block's retention changed since
            self._replace_retention(block, DEFAULT_PRIORITY, None)
            n += 1
        return n

    def set_retention(self, blocks: Iterable[KVBlock], retention: BlockRetention = DEFAULT_RETENTION) -> int:
        """Set the retention of cached blocks outright (a pin withdrawn: back to the default),
        whether held or evictable; an evictable one moves to the tail of its new level, a block
        set to the default to the head of the default level. Returns how many changed."""
        now, n = self.clock(), 0
        for block in blocks:
            if not is_reusable(block):
                continue
            expiry = (None if retention.duration_s is None or retention.priority == DEFAULT_PRIORITY
                      else now + retention.duration_s)
            if (block.priority, block.expiry) == (retention.priority, expiry):
                continue
            self._replace_retention(block, retention.priority, expiry)
            n += 1
        return n

    def _replace_retention(self, block: KVBlock, priority: int, expiry: float | None) -> None:
        """Set a cached block's retention outright, moving it if nobody holds it: back to the
        default (no retention left) to the head of the default level, else to its level's tail."""
        queued = block.ref_cnt == 0
        if queued:
            self.free_queue.remove(block)
        self._set_retention(block, priority, expiry)
        default = (priority, expiry) == (DEFAULT_PRIORITY, None)
        if default:
            block.retained = False
        if queued:
            self.free_queue.push(block, first=default)

    def cache_block(self, block: KVBlock, block_hash: bytes, parent_hash: bytes | None = None,
                    token_ids: Sequence[int] | None = None) -> bool:
        """Register a full, computed block under ``block_hash``; False if the hash is already cached.

        With ``parent_hash`` (the hash of the block before it) and its ``token_ids``, the block is
        also listed under its parent for ``longest_child``. When two requests computed the same
        block at once, the first registration wins and the second block stays unhashed (private to
        its request, recycled first when freed).
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash and self.cached.get(block_hash) is block
        if block_hash in self.cached or block.parent_hash is not None:    # taken, or a listed partial
            return False
        if block.ref_cnt == 0:                  # an empty block nobody holds: moves to the default level
            self.free_queue.remove(block)
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if parent_hash is not None and token_ids is not None:
            self._list(block, parent_hash, token_ids)
        if block.ref_cnt == 0:
            self.free_queue.push(block)
            self._num_evictable += 1
        return True

    def list_partial(self, block: KVBlock, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        """List a held, unhashed block under its parent with the tokens its first slots hold, before
        its last holder frees it: evictable like a cached block, a source for ``longest_child``."""
        if block.block_hash is not None or block.parent_hash is not None or block.ref_cnt == 0:
            raise ValueError(f"only a held block with no hash and no listing can be listed, not {block}")
        self._list(block, parent_hash, token_ids)

    def _list(self, block: KVBlock, parent_hash: bytes, token_ids: Sequence[int]) -> None:
        """Put a block under its parent in ``children``, with the tokens its first slots hold."""
        block.parent_hash, block.token_ids = parent_hash, tuple(token_ids)
        self.children.setdefault(parent_hash, {})[block.block_id] = block

    def longest_child(self, parent_hash: bytes, token_ids: Sequence[int]) -> tuple[KVBlock | None, int]:
        """The cached block under ``parent_hash`` whose tokens share the longest prefix with
        ``token_ids``, and that prefix's length; (None, 0) when none shares a first token.

        Looks at the ``MAX_SIBLINGS_SCANNED`` most recently cached siblings only, so a prefix
        followed by thousands of different continuations costs one admission no more than that.
        Changes nothing.
        """
        siblings = self.children.get(parent_hash)
        if not siblings:
            return None, 0
        best, best_len = None, 0
        for block in itertools.islice(reversed(siblings.values()), MAX_SIBLINGS_SCANNED):
            n = 0
            for a, b in zip(block.token_ids, token_ids, strict=False):    # token_ids may be shorter
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block, n
        return best, best_len

    def _forget(self, block: KVBlock) -> None:
        """Drop a block's hash from the map and its parent's list (the caller fixes the counters
        and the block's place in the queue)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        if block.parent_hash is not None:
            siblings = self.children[block.parent_hash]
            del siblings[block.block_id]
            if not siblings:
                del self.children[block.parent_hash]
            block.parent_hash = block.token_ids = None

    def reset_prefix_cache(self) -> int:
        """Forget the hash or listing of every evictable block (nobody holds it); returns how many.

        Used blocks keep their hashes, so the prefixes running requests and sessions hold stay
        shareable. The forgotten blocks become empty and move to the queue head (handed out
        first). Nothing is recorded in ``evicted_hashes``: the caller announces the reset itself.
        """
        dropped = [block for block in self.free_queue if is_reusable(block)]
        for block in dropped:
            self.free_queue.remove(block)
            self._forget(block)
            _clear_retention(block)
            self.free_queue.push(block)
        self._num_evictable -= len(dropped)
        return len(dropped)

    def stats(self) -> BlockPoolStats:
        """Counts for metrics, in O(1)."""
        usable = self.num_blocks - 1
        used = usable - len(self.free_queue)
        return BlockPoolStats(num_blocks=usable, num_free=len(self.free_queue),
                              num_cached=len(self.cached), num_used=used, usage=used / usable,
                              num_evictable=self._num_evictable)

    @property
    def expiry_heap(self) -> list[tuple[float, int, KVBlock]]:
        """The (expiry, block id, block) heap of retentions with a duration (read-only; stale entries included)."""
        return self._expiries

    def check_integrity(self) -> None:
        """Raise AssertionError unless queue, ref counts and hash map agree (``kvhive.kv.pool_invariants``)."""
        from kvhive.kv.pool_invariants import check_pool  # tests only; it imports this module
        check_pool(self)


def _clear_retention(block: KVBlock) -> None:
    """No retention: the default priority, no expiry (a block handed out, or forgotten)."""
    block.priority, block.expiry, block.retained = DEFAULT_PRIORITY, None, False


def is_reusable(block: KVBlock) -> bool:
    """Whether a block's contents can be reused: it has a hash, or a listing under its parent."""
    return block.block_hash is not None or block.parent_hash is not None
