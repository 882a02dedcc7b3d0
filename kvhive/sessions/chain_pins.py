"""Pins of stored responses' block chains beside their conversation's session (torch-free).

A conversation's session holds the KV of its newest turn only; a stored response that another
branch has since left behind keeps its own chain pinned here, under ``chain_pin_id``, so each
branch a client may continue (``previous_response_id``) finds its prefix in the store tiers. A pin
is what the session holder pins for a session (``SessionHolder.hold_session``), under its own id.

Budgets: the pinned blocks count in the keeper tier's server-wide rule (``SessionLimits``'s block
counts, as a session's do), and the blocks a key's chains pin beyond what its sessions hold count
in its ``--max-pinned-gb``. A chain that would go over either is not pinned (``pin`` says so):
its blocks stay in the prefix cache and the tiers while there is room, as any request's do.
A pin lives until its response is deleted or its conversation expires (``unpin``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvhive.sessions.errors import SessionLimit
from kvhive.sessions.limits import SessionLimits
from kvhive.sessions.session import Session


def chain_pin_id(owner: str | None, response_id: str) -> str:
    """The id a stored response's chain is pinned under (never a session's ``engine_id``: those
    hold a '/' after the owner and a session id, which has no '/' and never starts with 'resp:')."""
    return f"resp:{owner or '-'}/{response_id}"


class ChainPins:
    """The chains pinned for stored responses, by (owner, response id), within the limits."""

    def __init__(self, limits: SessionLimits, hold: Callable[[str, Sequence[bytes]], None]) -> None:
        """``hold(pin_id, hashes)``: pin these blocks in the store tiers under ``pin_id``, replacing
        its older pins (no hashes: unpin)."""
        self.limits = limits
        self.hold = hold
        self._chains: dict[tuple[str | None, str], list[str]] = {}
        # Invariant: _owner_blocks[o][h] == number of o's chains in _chains holding h (> 0).
        self._owner_blocks: dict[str | None, Counter[str]] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def pin(self, owner: str | None, response_id: str, block_hashes: list[str], owned: Iterable[Session]) -> bool:
        """Pin the response's chain (hex block hashes); False when it would take the keeper tier or
        the key (whose sessions are ``owned``) over a limit: then nothing is pinned."""
        key = (owner, response_id)
        if key in self._chains or not block_hashes:
            return key in self._chains
        try:
            self._check(owner, block_hashes, list(owned))
        except SessionLimit:
            return False
        self._chains[key] = block_hashes
        self._count(owner, block_hashes, 1)
        self.hold(chain_pin_id(owner, response_id), [bytes.fromhex(h) for h in block_hashes])
        return True

    def unpin(self, owner: str | None, response_ids: Iterable[str]) -> int:
        """Drop the pins of these responses (those pinned); how many."""
        dropped = 0
        for response_id in response_ids:
            hashes = self._chains.pop((owner, response_id), None)
            if hashes is None:
                continue
            self._count(owner, hashes, -1)
            self.hold(chain_pin_id(owner, response_id), [])
            dropped += 1
        return dropped

    def pinned(self, owner: str | None, response_id: str) -> list[str] | None:
        """The chain pinned for the response, or None."""
        return self._chains.get((owner, response_id))

    def _count(self, owner: str | None, block_hashes: list[str], delta: int) -> None:
        self.limits.count_blocks(block_hashes, delta)
        counts = self._owner_blocks.setdefault(owner, Counter())
        for h in set(block_hashes):
            counts[h] += delta
            if counts[h] <= 0:
                del counts[h]
        if not counts:
            del self._owner_blocks[owner]

    def _check(self, owner: str | None, block_hashes: list[str], owned: list[Session]) -> None:
        """SessionLimit when the chain's blocks no chain or session pins yet would not fit the
        keeper tier, or its blocks beyond the key's sessions' would take the key over its limit."""
        limits = self.limits
        new = set(block_hashes) - limits.pinned_hashes()
        limits.check_keeper_blocks(len(new))
        held = {h for s in owned for h in s.block_hashes}
        extra = (set(self._owner_blocks.get(owner, ())) | set(block_hashes)) - held
        limits.check_key_extra(owner, owned, len(extra) * limits.block_bytes)
