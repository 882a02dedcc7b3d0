"""Session holdings: the device blocks a session keeps alive between its requests.

When a request of a session ends, the manager parks its blocks (the partial last block included)
and its block hashes in a ``SessionBlocks`` holding instead of freeing them, so their ref counts
keep them out of the free queue; the session's next request takes them back when its prompt
starts with the tokens they hold (``prefix_of``): no hashing, no lookup. A request id holds blocks
in the manager's tables or a session id holds them here, never both. ``fork`` gives a second
session its own holding of another's full blocks (each holding references them; nobody writes
into a full block).

A released holding's blocks take the parking request's retention; a holding released under
memory pressure (spilled) is pinned until the session ends (``kvhive.kv.retention_policy``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvhive.core.retention import RetentionSpec
from kvhive.kv.partial_copies import PartialCopies
from kvhive.kv.pool import BlockPool, KVBlock
from kvhive.kv.retention_policy import SpillPins, at_least_pinned, block_retentions
from kvhive.kv.window_group import WindowGroup
from kvhive.request import Request


@dataclass(eq=False)
class SessionBlocks:
    """The blocks a session keeps alive between its requests, and what they hold."""

    token_ids: list[int]             # the session's tokens; KV is in the blocks for the first
    num_computed_tokens: int         # num_computed_tokens of them (the last sampled one has none)
    blocks: list[KVBlock]
    block_hashes: list[bytes]        # chained hashes of the full blocks of token_ids
    num_cached_blocks: int           # leading blocks registered in the pool's hash map
    last_used: int = 0               # park order, for least-recently-used spilling (set by ``put``)
    retention: RetentionSpec | None = None   # the parking request's, given to the blocks as they are freed
    num_prompt_tokens: int = 0


def window_key(session_id: str) -> tuple[str, str]:
    """The owner key of a session's holding in the window group (beside request ids)."""
    return ("session", session_id)


class SessionHoldings:
    """Session id -> ``SessionBlocks``, with the count of distinct blocks they hold and the pins of
    spilled sessions' blocks."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool,
                 window: WindowGroup | None, copies: PartialCopies) -> None:
        """``window``: the window layers' group, whose session entries follow the holdings.
        ``copies``: lists a holding's partly computed block as it is released."""
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.copies = copies
        self._spill_pins = SpillPins(pool)
        # Insertion order = park order (least recently used first).
        self._held: dict[str, SessionBlocks] = {}
        # Invariant: _block_refs[id] == number of holdings in _held whose blocks hold id (> 0).
        self._block_refs: Counter[int] = Counter()
        self._park_counter = 0

    def put(self, session_id: str, holding: SessionBlocks) -> None:
        """Store a holding for a session that has none (its blocks' references move in with it)."""
        self._park_counter += 1
        holding.last_used = self._park_counter
        self._held[session_id] = holding
        self._block_refs.update(block.block_id for block in holding.blocks)

    def take(self, session_id: str) -> SessionBlocks | None:
        """Remove and return the session's holding (its blocks keep their references)."""
        held = self._held.pop(session_id, None)
        if held is not None:
            refs = self._block_refs
            for block in held.blocks:
                refs[block.block_id] -= 1
                if refs[block.block_id] == 0:
                    del refs[block.block_id]
        return held

    def prefix_of(self, request: Request) -> int:
        """Tokens of the request's session KV that its prompt continues (0: none held, or diverged).

        A token comparison only (C speed), never a hash: the holding's tokens must all be a prefix
        of the request's, so its KV covers ``num_computed_tokens`` of them and at least one token
        is left to compute.
        """
        held = self._held.get(request.session_id) if request.session_id else None
        if held is None or held.num_computed_tokens == 0:
            return 0
        n = len(held.token_ids)
        if n >= request.num_tokens or request.all_token_ids[:n] != held.token_ids:
            return 0
        return held.num_computed_tokens

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give ``child_id`` its own holding of the parent's full blocks within its first
        ``num_tokens`` tokens (replacing an older one); the tokens shared (0: the parent holds no
        full block of them, or window layers are in use).

        Copy-on-write by construction: a shared block is full and computed, and neither side ever
        writes into a full block; each side's next request writes from its own end on, into blocks
        of its own (the partial last block is never shared). Each holding takes a reference on
        every shared block, so either side's release leaves the other's.
        """
        held = self._held.get(parent_id)
        if held is None or self.window is not None or parent_id == child_id:
            return 0
        num_full = min(num_tokens, held.num_computed_tokens) // self.block_size
        num_full = min(num_full, len(held.blocks))
        if self.enable_prefix_caching:            # without it, blocks are not hashed (tokens match them)
            num_full = min(num_full, len(held.block_hashes))
        self.release(child_id)
        if num_full == 0:
            return 0
        blocks = held.blocks[:num_full]
        self.pool.touch(blocks)
        num_shared = num_full * self.block_size
        self.put(child_id, SessionBlocks(
            token_ids=held.token_ids[:num_shared], num_computed_tokens=num_shared, blocks=blocks,
            block_hashes=held.block_hashes[:num_full], num_cached_blocks=min(held.num_cached_blocks, num_full),
            retention=held.retention, num_prompt_tokens=min(held.num_prompt_tokens, num_shared)))
        return num_shared

    def release(self, session_id: str, spill: bool = False) -> bool:
        """Free the blocks a session holds, tail first (full ones stay cached), with the parking
        request's retention; ``spill`` (memory pressure, the session lives on): at least pinned
        until the session ends. False if none."""
        held = self.take(session_id)
        if held is None:
            return False
        self.copies.list_partial(held.blocks, held.block_hashes, held.token_ids, held.num_computed_tokens)
        kept = block_retentions(held.retention, len(held.blocks), self.block_size, len(held.token_ids),
                                held.num_prompt_tokens)
        self.pool.free_blocks(reversed(held.blocks), reversed(at_least_pinned(kept) if spill else kept))
        if spill:
            self._spill_pins.record(session_id, held.blocks)
        if self.window is not None:
            self.window.free(window_key(session_id))
        return True

    def end(self, session_id: str) -> bool:
        """The session ended: free its holding and withdraw the pins of its spilled blocks."""
        released = self.release(session_id)
        self.withdraw_spill_pins(session_id)
        return released

    def withdraw_spill_pins(self, session_id: str) -> None:
        """Let the blocks a spill of this session pinned fall back to their own retention."""
        self._spill_pins.withdraw(session_id)

    def ids(self) -> list[str]:
        """Sessions holding device blocks, least recently parked first."""
        return sorted(self._held, key=lambda sid: self._held[sid].last_used)

    def get(self, session_id: str) -> SessionBlocks | None:
        """The holding of a session, or None (read-only view)."""
        return self._held.get(session_id)

    def values(self) -> list[SessionBlocks]:
        """Every holding (read-only views)."""
        return list(self._held.values())

    @property
    def num_blocks(self) -> int:
        """Distinct device blocks held by sessions (a block two sessions share counts once)."""
        return len(self._block_refs)
