"""The "history" drafter's store: recent token sequences per tenant, indexed by n-gram.

Each tenant (a request's prefix-cache salt: its API key and the body's ``cache_salt``; None is the
anonymous tenant of requests without either) has its own ``TenantHistory``: a ring of sequences
(the prompt and output of its finished requests) in one token array, each followed by a separator,
and one dict from the hash of an n-gram (every length ``min_n..max_n``) to the position of the
token that followed its latest occurrence. Adding a sequence costs one entry per token and length;
evicting it (oldest first) removes just the entries that still point into it, so nothing is ever
rescanned and the index holds at most (tokens kept) x (lengths) entries. Lookups compare the
stored tokens with the n-gram, so a hash collision only loses a draft. A tenant's lookups read
its own store only: one tenant's text never drafts for another's.

``HistoryStore`` keeps the two caps: tokens per tenant and tokens in all, evicting the oldest
sequence of the tenant, or of all tenants, until a new sequence fits. Torch-free.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

SEPARATOR = -1          # follows every sequence in the token array; never a token id


@dataclass(frozen=True)
class HistoryStats:
    """What the store holds: tenants, sequences, tokens (separators not counted), index entries."""

    num_tenants: int
    num_sequences: int
    num_tokens: int
    num_index_entries: int


class StoredSequence(NamedTuple):
    """Where a sequence lies in its tenant's token array: its first token's offset, its length."""

    offset: int
    length: int


class TenantHistory:
    """One tenant's recent sequences and an n-gram hash -> latest follower position index.

    Positions are global offsets (they grow forever); ``_tokens[i]`` is at offset ``_base + i`` and
    the live tokens start at ``_tokens[_start]``."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens = array("q")
        self._base = 0
        self._start = 0
        self._sequences: deque[StoredSequence] = deque()      # oldest first
        self._index: dict[int, int] = {}
        self.num_tokens = 0

    @property
    def num_sequences(self) -> int:
        """Sequences kept."""
        return len(self._sequences)

    @property
    def num_index_entries(self) -> int:
        """Entries of the n-gram index."""
        return len(self._index)

    def add(self, token_ids: Sequence[int]) -> int:
        """Append a sequence and index its n-grams; its offset (the id ``evict_oldest`` returns)."""
        offset = self._base + len(self._tokens)
        self._tokens.extend(token_ids)
        self._tokens.append(SEPARATOR)
        self._sequences.append(StoredSequence(offset, len(token_ids)))
        self.num_tokens += len(token_ids)
        for key, follower in self._ngrams(token_ids, offset):
            self._index[key] = follower
        return offset

    def live(self) -> tuple[array, int, dict[int, int]]:
        """A copy of the live tokens, the offset of its first one, and each kept sequence's length
        by its offset: one array copy (a ``HistorySnapshot``'s part)."""
        return (self._tokens[self._start:], self._base + self._start,
                {offset: length for offset, length in self._sequences})

    def evict_oldest(self) -> StoredSequence:
        """Drop the oldest sequence and the index entries that point into it; where it was."""
        offset, length = self._sequences.popleft()
        local = offset - self._base
        token_ids = self._tokens[local:local + length]
        for key, follower in self._ngrams(token_ids, offset):
            # Sequences go oldest first: an entry still pointing here has no later occurrence.
            if self._index.get(key) == follower:
                del self._index[key]
        self.num_tokens -= length
        self._start = local + length + 1
        if self._start * 2 > len(self._tokens):              # compact: amortised O(1) per token
            del self._tokens[:self._start]
            self._base += self._start
            self._start = 0
        return StoredSequence(offset, length)

    def propose(self, context: Sequence[int], max_tokens: int, min_match: int = 0) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest stored occurrence of the longest
        suffix (``max_n`` down to ``min_n`` tokens, and at least ``min_match``) of ``context``;
        [] when none is stored."""
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, len(context)), max(self.min_n, min_match) - 1, -1):
            ngram = tuple(context[len(context) - n:])
            follower = self._index.get(hash(ngram))
            if follower is None:
                continue
            local = follower - self._base
            if local - n < self._start or tuple(self._tokens[local - n:local]) != ngram:
                continue                                      # a hash collision: no draft at this length
            draft = self._tokens[local:local + max_tokens].tolist()
            return draft[:draft.index(SEPARATOR)] if SEPARATOR in draft else draft
        return []

    def _ngrams(self, token_ids: Sequence[int], offset: int):
        """(hash of the n-gram, offset of its follower) for every n-gram of a sequence stored at
        ``offset`` that has a follower in it, in order of position."""
        for p in range(self.min_n, len(token_ids)):
            for n in range(self.min_n, min(self.max_n, p) + 1):
                yield hash(tuple(token_ids[p - n:p])), offset + p


class HistoryStore:
    """Every tenant's ``TenantHistory`` under two token caps, evicting oldest sequences first."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int, tenant_max_tokens: int) -> None:
        if not 1 <= tenant_max_tokens <= max_tokens:
            raise ValueError(f"history caps must satisfy 1 <= tenant ({tenant_max_tokens}) <= all ({max_tokens})")
        self.min_n, self.max_n = min_n, max_n
        self.max_tokens, self.tenant_max_tokens = max_tokens, tenant_max_tokens
        self._tenants: dict[str | None, TenantHistory] = {}
        self._order: OrderedDict[tuple[str | None, int], None] = OrderedDict()    # oldest sequence first
        self.num_tokens = 0
        self.changes = 0                 # sequences kept so far: the history file is stale while it grows

    def record(self, tenant: str | None, token_ids: Sequence[int]) -> None:
        """Keep a sequence (its last ``tenant_max_tokens`` tokens) for ``tenant``'s drafts, evicting
        that tenant's oldest sequences, then anyone's, until it fits both caps."""
        token_ids = token_ids[max(0, len(token_ids) - self.tenant_max_tokens):]
        if len(token_ids) <= self.min_n:
            return                                            # no n-gram with a follower
        history = self._tenants.get(tenant)
        while history is not None and history.num_tokens + len(token_ids) > self.tenant_max_tokens:
            self._evict(tenant)
            history = self._tenants.get(tenant)
        while self.num_tokens + len(token_ids) > self.max_tokens:
            self._evict(next(iter(self._order))[0])
        history = self._tenants.get(tenant)
        if history is None:
            history = self._tenants[tenant] = TenantHistory(self.min_n, self.max_n)
        self._order[(tenant, history.add(token_ids))] = None
        self.num_tokens += len(token_ids)
        self.changes += 1

    def propose(self, tenant: str | None, context: Sequence[int], max_tokens: int,
                min_match: int = 0) -> list[int]:
        """Up to ``max_tokens`` draft tokens from ``tenant``'s own history only, for a suffix of at
        least ``min_match`` tokens ([]: none)."""
        history = self._tenants.get(tenant)
        return [] if history is None else history.propose(context, max_tokens, min_match)

    def sequences(self) -> Iterator[tuple[str | None, list[int]]]:
        """(tenant, tokens) of every sequence kept, oldest first across tenants (the order the caps
        evict them in): what ``kvhive.engine.speculative.history_file`` writes."""
        return self.snapshot().sequences()

    def snapshot(self) -> HistorySnapshot:
        """A copy of what the store keeps now, to read on another thread while this one goes on
        changing: one array copy per tenant (milliseconds for a million tokens), no token lists."""
        return HistorySnapshot(list(self._order), {tenant: history.live() for tenant, history in self._tenants.items()})

    def stats(self) -> HistoryStats:
        """What the store holds now."""
        tenants = self._tenants.values()
        return HistoryStats(len(self._tenants), sum(t.num_sequences for t in tenants), self.num_tokens,
                            sum(t.num_index_entries for t in tenants))

    def _evict(self, tenant: str | None) -> None:
        """Drop ``tenant``'s oldest sequence (and the tenant once it holds none)."""
        history = self._tenants[tenant]
        offset, length = history.evict_oldest()
        del self._order[(tenant, offset)]
        self.num_tokens -= length
        if history.num_sequences == 0:
            del self._tenants[tenant]


class HistorySnapshot:
    """The sequences a ``HistoryStore`` kept at one moment (``HistoryStore.snapshot``)."""

    def __init__(self, order: list[tuple[str | None, int]],
                 tenants: dict[str | None, tuple[array, int, dict[int, int]]]) -> None:
        self._order, self._tenants = order, tenants

    def sequences(self) -> Iterator[tuple[str | None, list[int]]]:
        """(tenant, tokens) of every sequence, oldest first across tenants."""
        for tenant, offset in self._order:
            tokens, first, lengths = self._tenants[tenant]
            local = offset - first
            yield tenant, tokens[local:local + lengths[offset]].tolist()
