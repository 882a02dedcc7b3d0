"""Prompt -> KV scores per replica (llm-d's KVCacheIndexer): tokenize, hash, look up, score."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhive.core.blocks import ExtraKeys, hash_blocks
from kvhive.routing.index import KVBlockIndex
from kvhive.routing.prompts import Prompt, PromptPieces, PromptTokenizer
from kvhive.routing.scorer import KVBlockScorer, TierWeights


@dataclass(frozen=True)
class KVScores:
    """What the index says about one prompt: replica -> score in blocks, out of ``num_blocks``."""

    scores: dict[str, float] = field(default_factory=dict)
    num_blocks: int = 0
    num_tokens: int = 0
    tokenize_s: float = 0.0


class BlockKeyCache:
    """A prompt's block keys, cached per prefix-store piece, so a repeated prefix is not hashed again.

    Entry (salt encoding, piece key) -> the keys of the blocks that end inside that piece. A piece's
    key names the pieces up to it (their ids and so the number of tokens before it), so with the
    salt it fixes those blocks' keys. Bounded, LRU.
    """

    def __init__(self, block_size: int, root: bytes, max_pieces: int = 100_000) -> None:
        self.block_size = block_size
        self.root = root
        self.max_pieces = max_pieces
        self._lock = threading.Lock()
        self._pieces: OrderedDict[tuple[bytes, bytes], tuple[bytes, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pieces)

    def block_keys(self, pieces: PromptPieces, cache_salt: str | None) -> list[bytes]:
        """``hash_blocks`` of the pieces' ids salted with ``cache_salt``: cached pieces first, then
        the rest hashed (and cached) from the last cached block on."""
        extra = ExtraKeys(cache_salt=cache_salt).encode()
        entries = [(extra, key) for key in pieces.keys]     # unkeyed pieces are never found
        keys: list[bytes] = []
        done = self._take_cached(entries, keys)             # pieces whose keys are cached
        if done == len(entries):
            return keys
        num_tokens = sum(map(len, pieces.ids[:done]))     # len(keys) == num_tokens // block_size
        # 1. The ids from the first block not hashed yet: the partial block's tokens, then the rest.
        ids = self._unhashed_ids(pieces, done, num_tokens - len(keys) * self.block_size)
        # 2. Chain on from the last cached block: ``ids`` starts at a block boundary, so that block's
        #    key stands in for the root (block 0 alone carries the salt).
        new = hash_blocks(ids, self.block_size, keys[-1] if keys else self.root,
                          None if keys else ExtraKeys(cache_salt=cache_salt))
        # 3. Cache each new piece's share of the new blocks.
        first_new = len(keys)
        keys.extend(new)
        self._cache_pieces(entries[done:], pieces.ids[done:], keys, first_new, num_tokens)
        return keys

    def _take_cached(self, entries: list[tuple[bytes, bytes | None]], keys: list[bytes]) -> int:
        """Append the cached keys of the leading ``entries`` found to ``keys`` (marking each entry
        recently used); the number of entries found, up to the first missing one."""
        done = 0
        with self._lock:
            for entry in entries:
                cached = self._pieces.get(entry)
                if cached is None:
                    break
                self._pieces.move_to_end(entry)
                keys.extend(cached)
                done += 1
        return done

    @staticmethod
    def _unhashed_ids(pieces: PromptPieces, done: int, partial: int) -> list[int]:
        """The ids of the pieces from ``done`` on, led by the last ``partial`` ids of the pieces
        before it (the tokens of the block that the cached pieces left unfinished)."""
        ids: list[int] = []
        back, need = done, partial
        while need > 0:
            back -= 1
            ids[:0] = pieces.ids[back][max(0, len(pieces.ids[back]) - need):]
            need -= len(pieces.ids[back])
        for piece_ids in pieces.ids[done:]:
            ids.extend(piece_ids)
        return ids

    def _cache_pieces(self, entries: list[tuple[bytes, bytes | None]], piece_ids: list[Sequence[int]],
                      keys: list[bytes], first_new: int, num_tokens: int) -> None:
        """Cache each of ``entries`` (the pieces after the first ``num_tokens`` tokens) with the keys
        of the blocks that end inside it, ``keys[first_new:]`` in order; then evict the least
        recently used entries beyond ``max_pieces``."""
        with self._lock:
            for entry, ids in zip(entries, piece_ids, strict=True):
                num_tokens += len(ids)
                end = num_tokens // self.block_size
                if entry[1] is not None:
                    self._pieces[entry] = tuple(keys[first_new:end])
                first_new = end
            while len(self._pieces) > self.max_pieces:
                self._pieces.popitem(last=False)


class KVCacheIndexer:
    """Scores replicas for a prompt by the KV blocks the index says they hold."""

    def __init__(self, tokenizer: PromptTokenizer, index: KVBlockIndex, scorer: KVBlockScorer,
                 tiers: TierWeights, block_size: int, root: bytes) -> None:
        self.tokenizer = tokenizer
        self.index = index
        self.scorer = scorer
        self.tiers = tiers
        self.block_size = block_size
        self.root = root
        self.block_keys = BlockKeyCache(block_size, root, max(1, tokenizer.max_chunks))

    # Up to this many characters of text not in the prefix store, scoring costs less than two
    # thread hops to the tokenizer pool (each a wake-up that waits for a core on a busy machine):
    # it runs on the event loop. That covers short prompts and long ones whose prefix is cached.
    inline_chars: int = 1024

    async def score(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt``: on the calling thread when little of its text needs tokenizing,
        else on the tokenizer pool (the event loop never waits on a long tokenization)."""
        start = time.perf_counter()
        pieces = self.tokenizer.pieces(prompt, max_new_chars=self.inline_chars)
        if pieces is None:
            return await self.tokenizer.run(self.score_sync, prompt)
        return self._score_pieces(pieces, prompt.cache_salt, time.perf_counter() - start)

    def score_sync(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt`` on the calling thread."""
        # 1. Token ids, exactly as the replica computes them (prefix store for long texts).
        start = time.perf_counter()
        pieces = self.tokenizer.pieces(prompt)
        assert pieces is not None                 # no max_new_chars: always tokenized
        return self._score_pieces(pieces, prompt.cache_salt, time.perf_counter() - start)

    def _score_pieces(self, pieces: PromptPieces, cache_salt: str | None, tokenize_s: float) -> KVScores:
        # 2. Block keys: kvhive's chained hash of the full blocks, salted as the replica salts them
        #    (cached per prefix-store piece).
        keys = self.block_keys.block_keys(pieces, cache_salt)
        # 3. Who holds each key, up to the first key nobody holds (one index round trip).
        hits = self.index.lookup(keys)
        # 4. Replica -> tier-weighted score in blocks.
        scores = self.scorer.score(hits, self.tiers)
        return KVScores(scores, len(keys), sum(map(len, pieces.ids)), tokenize_s)
