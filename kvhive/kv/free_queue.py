"""The block pool's free queue: blocks nobody holds, in the order they are handed out again.

``FreeBlockQueue`` is an intrusive doubly linked list (O(1) popleft, append, appendleft, remove).
``PriorityFreeQueue`` is what the pool keeps: one such list of empty blocks (their contents are
reusable by nobody), handed out first, then one list per retention priority present among the
evictable blocks, lowest priority first and least recently freed first within a priority:

    empty            head ... tail          (an empty block goes to the head)
    priority p0      head ... tail          p0 < p1 < ...; a freed block goes to its level's tail
    priority p1      head ... tail          (a block whose priority expired goes to the head)

Levels are kept in a sorted list (at most 101 of them), so finding the lowest is O(1) and adding
or dropping a level O(log P) to find plus a short list shift. A queued block's list is decided by
its state alone: the empty list iff it holds nothing reusable, else the list of ``block.priority``;
the caller changes neither while the block is queued (it takes the block out first).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhive.kv.pool import KVBlock


class FreeBlockQueue:
    """Intrusive doubly linked list of blocks: O(1) popleft, append, appendleft and remove.

    The head is the least recently freed block (evicted first), the tail the most recent.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head
        while node is not None:
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        """Remove and return the head (the block to evict next)."""
        block = self._head
        if block is None:
            raise IndexError("popleft from an empty free queue")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        """Add a block at the tail (evicted last)."""
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        self._len += 1

    def appendleft(self, block: KVBlock) -> None:
        """Add a block at the head (handed out first)."""
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink a block from anywhere in the queue; the caller guarantees it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None:
            self._head = nxt
        else:
            prev.next_free = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class PriorityFreeQueue:
    """Empty blocks first, then evictable blocks by priority (lowest first), LRU within a priority.

    Iterating yields the blocks in the order ``popleft`` would hand them out.
    """

    def __init__(self, blocks: Iterable[KVBlock], reusable: Callable[[KVBlock], bool]) -> None:
        """``blocks`` start empty; ``reusable(block)`` says which list a queued block is in."""
        self.empty = FreeBlockQueue(blocks)
        self.levels: dict[int, FreeBlockQueue] = {}
        # Invariant: levels_order == sorted(levels), and every list in levels is non-empty.
        self.levels_order: list[int] = []
        self._reusable = reusable
        # Invariant: the blocks in all the lists, kept in O(1).
        self._len = len(self.empty)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.empty
        for priority in list(self.levels_order):
            yield from self.levels[priority]

    def popleft(self) -> KVBlock:
        """Remove and return the next block to hand out: an empty one, else the lowest priority's LRU."""
        if len(self.empty):
            self._len -= 1
            return self.empty.popleft()
        if not self.levels_order:
            raise IndexError("popleft from an empty free queue")
        priority = self.levels_order[0]
        block = self.levels[priority].popleft()
        self._drop_if_empty(priority)
        self._len -= 1
        return block

    def push(self, block: KVBlock, first: bool = False) -> None:
        """Queue a block nobody holds: an empty one at the head of the empty list; an evictable one
        at the tail of its priority's list (``first``: at its head, evicted before its peers)."""
        self._len += 1
        if not self._reusable(block):
            self.empty.appendleft(block)
            return
        queue = self.levels.get(block.priority)
        if queue is None:
            queue = self.levels[block.priority] = FreeBlockQueue()
            bisect.insort(self.levels_order, block.priority)
        if first:
            queue.appendleft(block)
        else:
            queue.append(block)

    def remove(self, block: KVBlock) -> None:
        """Unlink a queued block (its state must be what it was when it was pushed)."""
        self._len -= 1
        if not self._reusable(block):
            self.empty.remove(block)
            return
        self.levels[block.priority].remove(block)
        self._drop_if_empty(block.priority)

    def _drop_if_empty(self, priority: int) -> None:
        if not len(self.levels[priority]):
            del self.levels[priority]
            del self.levels_order[bisect.bisect_left(self.levels_order, priority)]
