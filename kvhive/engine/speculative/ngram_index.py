"""The prompt-lookup drafter: an incremental index of one token sequence's n-grams.

For each length n in ``min_n..max_n`` a dict maps an n-gram to the position right after its latest
occurrence whose next token is known. Appending a token adds one entry per length (the n-grams
that now have a next token), so drafting costs O(max_n^2) per token however long the sequence is;
the sequence is never rescanned. ``follow`` looks up another sequence's suffix in the index (method
"history" drafts from the tenant's running requests with it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class NgramIndex:
    """The n-grams of a growing token sequence, for drafting what followed the current suffix."""

    def __init__(self, min_n: int, max_n: int, token_ids: Iterable[int] = ()) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # _next[n - min_n][ngram] = p: tokens[p - n:p] == ngram and tokens[p] is known (p < len(tokens)).
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens; each makes the n-grams ending just before it followers of a known token."""
        tokens = self.tokens
        for token in token_ids:
            end = len(tokens)          # the n-grams ending at end - 1 are followed by this token
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next[n - self.min_n][tuple(tokens[end - n:end])] = end
            tokens.append(token)

    def propose(self, max_tokens: int, min_match: int = 0) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest
        suffix (``max_n`` down to ``min_n`` tokens, and at least ``min_match``) of the sequence;
        [] when no such suffix occurred before."""
        return self.follow(self.tokens, max_tokens, min_match)

    def follow(self, context: Sequence[int], max_tokens: int, min_match: int = 0) -> list[int]:
        """Up to ``max_tokens`` tokens that followed, in this sequence, the latest occurrence of the
        longest suffix of ``context`` (``max_n`` down to ``min_n`` tokens, and at least
        ``min_match``) that has a known follower here; [] when none has."""
        if max_tokens <= 0:
            return []
        tokens, end = self.tokens, len(context)
        # The whole sequence as an n-gram has no follower in it, so its own suffix of n = end never matches.
        for n in range(min(self.max_n, end), max(self.min_n, min_match) - 1, -1):
            start = self._next[n - self.min_n].get(tuple(context[end - n:]))
            if start is not None:
                return tokens[start:start + max_tokens]
        return []
