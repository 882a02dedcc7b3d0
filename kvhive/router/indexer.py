"""Prompt -> KV scores per replica (seed 001's KVCacheIndexer): tokenize, hash, look up, score."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvhive.blocks import ExtraKeys, hash_blocks
from kvhive.router.index import KVBlockIndex
from kvhive.router.scorer import KVBlockScorer, TierWeights
from kvhive.router.tokenize import Prompt, PromptTokenizer


def prompt_chars(prompt: Prompt) -> int:
    """About how much text ``prompt`` holds (0 for token ids: they need no tokenizing)."""
    if prompt.text is not None:
        return len(prompt.text)
    if prompt.messages is not None:
        return sum(len(m.get("content") or "") for m in prompt.messages) + 64 * len(prompt.messages)
    return 0


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

    # Below this many characters of text, scoring costs less than a hop to the tokenizer pool
    # (tens of microseconds): it runs on the event loop.
    inline_chars: int = 1024

    async def score(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt``: short prompts on the calling thread, long ones on the tokenizer
        pool (the event loop never waits on a long tokenization)."""
        if prompt_chars(prompt) <= self.inline_chars:
            return self.score_sync(prompt)
        return await self.tokenizer.run(self.score_sync, prompt)

    def score_sync(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt`` on the calling thread."""
        # 1. Token ids, exactly as the replica computes them (prefix store for long texts).
        start = time.perf_counter()
        token_ids = self.tokenizer.token_ids(prompt)
        tokenized = time.perf_counter()
        # 2. Block keys: kvhive's chained hash of the full blocks, salted as the replica salts them.
        keys = hash_blocks(token_ids, self.block_size, self.root, ExtraKeys(cache_salt=prompt.cache_salt))
        # 3. Who holds each key, up to the first key nobody holds (one index round trip).
        hits = self.index.lookup(keys)
        # 4. Replica -> tier-weighted score in blocks.
        scores = self.scorer.score(hits, self.tiers)
        return KVScores(scores, len(keys), len(token_ids), tokenized - start)
