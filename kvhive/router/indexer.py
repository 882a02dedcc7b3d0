"""Prompt -> KV scores per replica (seed 001's KVCacheIndexer): tokenize, hash, look up, score."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvhive.blocks import ExtraKeys, hash_blocks
from kvhive.router.index import KVBlockIndex
from kvhive.router.scorer import KVBlockScorer, TierWeights
from kvhive.router.tokenize import Prompt, PromptTokenizer


@dataclass(frozen=True)
class KVScores:
    """What the index says about one prompt: replica -> score in blocks, out of ``num_blocks``."""

    scores: dict[str, float] = field(default_factory=dict)
    num_blocks: int = 0
    num_tokens: int = 0
    tokenize_s: float = 0.0


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

    # Up to this many characters of text not in the prefix store, scoring costs less than two
    # thread hops to the tokenizer pool (each a wake-up that waits for a core on a busy machine):
    # it runs on the event loop. That covers short prompts and long ones whose prefix is cached.
    inline_chars: int = 1024

    async def score(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt``: on the calling thread when little of its text needs tokenizing,
        else on the tokenizer pool (the event loop never waits on a long tokenization)."""
        start = time.perf_counter()
        token_ids = self.tokenizer.token_ids(prompt, max_new_chars=self.inline_chars)
        if token_ids is None:
            return await self.tokenizer.run(self.score_sync, prompt)
        return self._score_ids(token_ids, prompt.cache_salt, time.perf_counter() - start)

    def score_sync(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt`` on the calling thread."""
        # 1. Token ids, exactly as the replica computes them (prefix store for long texts).
        start = time.perf_counter()
        token_ids = self.tokenizer.token_ids(prompt)
        assert token_ids is not None                 # no max_new_chars: always tokenized
        return self._score_ids(token_ids, prompt.cache_salt, time.perf_counter() - start)

    def _score_ids(self, token_ids: list[int], cache_salt: str | None, tokenize_s: float) -> KVScores:
        # 2. Block keys: kvhive's chained hash of the full blocks, salted as the replica salts them.
        keys = hash_blocks(token_ids, self.block_size, self.root, ExtraKeys(cache_salt=cache_salt))
        # 3. Who holds each key, up to the first key nobody holds (one index round trip).
        hits = self.index.lookup(keys)
        # 4. Replica -> tier-weighted score in blocks.
        scores = self.scorer.score(hits, self.tiers)
        return KVScores(scores, len(keys), len(token_ids), tokenize_s)
