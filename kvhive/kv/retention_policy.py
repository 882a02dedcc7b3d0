"""Which retention the device pool gives the blocks the manager frees (torch-free).

- A request's blocks, as it ends: block i (tokens ``[i * B, (i + 1) * B)``, cut to the tokens it
  holds) takes ``request.retention.block_retention`` (``kvhive.core.retention``); a request
  without one gives every block the default priority. The pool keeps the stronger of that and the
  block's live retention, so a one-off request never demotes a prefix someone pinned.
- A session's holding: while parked its blocks are referenced, never evictable. Released because
  the session ended or its history diverged, they take the retention of the request that parked
  them. Spilled under memory pressure (``kvhive.engine.scheduler.session_spill``), they take at
  least ``PINNED_PRIORITY`` with no duration, so they outlive one-off prompts; ``SpillPins``
  remembers them, and the pin is withdrawn (back to the default priority) when the session ends
  (its request with ``end_session``, a delete, or the sessions' sweeper ending it at its TTL) or is
  spilled again with another history. A session's TTL is thereby enforced by the sweeper, not by a
  duration on its blocks.
- KV events: the pool's priority changes of cached blocks become ``BlockUpdated`` events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvhive.core.kv_events import MEDIUM_GPU, BlockUpdated
from kvhive.core.retention import DEFAULT_RETENTION, PINNED_PRIORITY, BlockRetention, RetentionSpec
from kvhive.kv.pool import BlockPool, KVBlock, PriorityChange

SPILL_PIN = BlockRetention(PINNED_PRIORITY, None)


def block_retentions(spec: RetentionSpec | None, num_blocks: int, block_size: int, num_tokens: int,
                     num_prompt_tokens: int) -> list[BlockRetention]:
    """The retention of each of a sequence's first ``num_blocks`` blocks (table order) for a
    sequence of ``num_tokens`` tokens whose first ``num_prompt_tokens`` are its prompt."""
    if spec is None:
        return [DEFAULT_RETENTION] * num_blocks
    return [block_retention_at(spec, i, block_size, num_tokens, num_prompt_tokens) for i in range(num_blocks)]


def block_retention_at(spec: RetentionSpec | None, index: int, block_size: int, num_tokens: int,
                       num_prompt_tokens: int) -> BlockRetention:
    """The retention of block ``index`` of such a sequence (the tokens it holds, at most a block)."""
    if spec is None:
        return DEFAULT_RETENTION
    start = index * block_size
    return spec.block_retention(start, max(start + 1, min(start + block_size, num_tokens)), num_prompt_tokens)


def at_least_pinned(retentions: Sequence[BlockRetention]) -> list[BlockRetention]:
    """Each retention raised to the spill pin where that is stronger (a higher one stays)."""
    return [r if r.priority > PINNED_PRIORITY else SPILL_PIN for r in retentions]


class SpillPins:
    """The blocks of spilled session holdings, pinned until their session ends or spills again."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        # Session id -> (block, the hash it had when pinned) of its spilled cached blocks.
        self._pins: dict[str, list[tuple[KVBlock, bytes]]] = {}

    def record(self, session_id: str, blocks: Sequence[KVBlock]) -> None:
        """Remember a spilled holding's cached blocks (their pins were given as they were freed);
        a pin the session's previous spill left on other blocks is withdrawn."""
        pins = [(b, b.block_hash) for b in blocks if b.block_hash is not None]
        kept = {b.block_id for b, _ in pins}
        old = self._pins.pop(session_id, [])
        self._demote([(b, h) for b, h in old if b.block_id not in kept])
        if pins:
            self._pins[session_id] = pins

    def withdraw(self, session_id: str) -> int:
        """The session ended: its spilled blocks fall back to the default priority (those still
        holding what they held, and still at the spill pin). Returns how many."""
        return self._demote(self._pins.pop(session_id, []))

    def __len__(self) -> int:
        return len(self._pins)

    def _demote(self, pins: list[tuple[KVBlock, bytes]]) -> int:
        mine = [b for b, h in pins if b.block_hash == h and (b.priority, b.expiry) == (SPILL_PIN.priority, None)]
        return self.pool.set_retention(mine, DEFAULT_RETENTION)


def priority_events(changes: Sequence[PriorityChange], cached: Mapping[bytes, KVBlock]) -> list[BlockUpdated]:
    """KV events for the pool's priority changes, in order: a run of changes with the same old and
    new priority is one BlockUpdated; blocks no longer cached (evicted since) are left out."""
    out: list[BlockUpdated] = []
    for change in changes:
        if change.block_hash not in cached:
            continue
        last = out[-1] if out else None
        if last is not None and (last.old_priority, last.priority) == (change.old_priority, change.new_priority):
            last.block_hashes.append(change.block_hash)
        else:
            out.append(BlockUpdated([change.block_hash], change.new_priority, change.old_priority, MEDIUM_GPU))
    return out
