"""kvhive's routing for one Ray Serve deployment, free of Ray: the routing library's index, event
ingesters, indexer and ``pick_replica``, keyed by Ray's replica ids.

Each replica states in its metadata (``ReplicaFacts``) its model file, block geometry, fingerprint
and KV-event endpoints. The first replica seen fixes the block keys (every replica of a deployment
runs one config); each replica's events feed the shared index through its own ``ReplicaIngest``.
A request is ranked by its session's holder first, then by KV score, its prompt_cache_key's
replica and load; with no prompt, or before any replica has stated its facts, by the key's replica
and load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhive.core.blocks import root_hash
from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.block_keys import BlockKeyMapper
from kvhive.routing.index import InMemoryIndex, KVBlockIndex
from kvhive.routing.indexer import KVCacheIndexer, KVScores
from kvhive.routing.ingest import ReplicaIngest
from kvhive.routing.prompts import Prompt, PromptTokenizer
from kvhive.routing.scorer import SCORERS, LoadStats, RoutingWeights, TierWeights, pick_replica

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaFacts:
    """What a replica states about itself once it is ready (Ray's replica metadata)."""

    model_path: str
    block_size: int
    hash_seed: int
    fingerprint: str
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ReplicaFacts | None:
        """The facts in ``metadata``, or None when it holds none (a replica of another kind)."""
        try:
            return cls(str(metadata["model_path"]), int(metadata["block_size"]), int(metadata["hash_seed"]),
                       str(metadata["fingerprint"]), metadata.get("kv_events"), metadata.get("kv_events_replay"))
        except (KeyError, TypeError, ValueError):
            return None

    def as_metadata(self) -> dict[str, Any]:
        """These facts as Ray replica metadata."""
        return dict(vars(self))


@dataclass(frozen=True)
class Ranking:
    """Replica ids in order of preference and why the first is first (session, kv or load)."""

    replicas: list[str]
    reason: str
    kv_blocks: float = 0.0


class ReplicaRouting:
    """Index, ingesters and scorer of one deployment's replicas; ranks replicas for a request."""

    def __init__(self, scorer: str = "longest_prefix", tiers: TierWeights | None = None,
                 weights: RoutingWeights | None = None, index: KVBlockIndex | None = None,
                 load_tokenizer: Callable[[str], Tokenizer] = Tokenizer.from_model_path) -> None:
        self.scorer = SCORERS[scorer]()
        self.tiers = tiers or TierWeights()
        self.weights = weights or RoutingWeights()
        self.index = index if index is not None else InMemoryIndex()
        self.ingests: dict[str, ReplicaIngest] = {}
        self.facts: ReplicaFacts | None = None
        self._load_tokenizer = load_tokenizer
        self._indexer: KVCacheIndexer | None = None
        self._indexer_lock = asyncio.Lock()
        self._turn = 0

    def add_replica(self, replica: str, facts: ReplicaFacts | None) -> None:
        """Start following ``replica``'s KV events (once; replicas whose facts name other block keys
        than the first replica's are routed by load)."""
        if replica in self.ingests or facts is None:
            return
        if self.facts is None:
            self.facts = facts
        elif (facts.block_size, facts.hash_seed, facts.fingerprint) != (
                self.facts.block_size, self.facts.hash_seed, self.facts.fingerprint):
            logger.warning("replica %s hashes blocks unlike the others: routed by load", replica)
            return
        mapper = BlockKeyMapper(False, facts.block_size, root_hash(facts.hash_seed, facts.fingerprint))
        ingest = ReplicaIngest(replica, self.index, mapper, facts.kv_events, facts.kv_events_replay)
        self.ingests[replica] = ingest
        ingest.start()

    def drop_replica(self, replica: str) -> None:
        """Forget every block ``replica`` held and stop following its events (it died or left)."""
        ingest = self.ingests.pop(replica, None)
        if ingest is not None:
            ingest.close(timeout_s=0.5)
        self.index.clear_replica(replica)

    def close(self) -> None:
        """Stop every ingester and the tokenizer pool."""
        for replica in list(self.ingests):
            self.drop_replica(replica)
        if self._indexer is not None:
            self._indexer.tokenizer.close()

    async def rank(self, replicas: Sequence[str], prompt: Prompt | None, holder: str | None,
                   loads: Mapping[str, LoadStats], key_holder: str | None = None) -> Ranking:
        """``replicas`` in order of preference: ``holder`` first while it is one of them, else by
        ``pick_replica`` over the prompt's KV scores, ``key_holder`` (the replica that last answered
        the request's prompt_cache_key) and ``loads``."""
        if not replicas:
            raise ValueError("rank needs at least one replica")
        self._turn += 1
        if holder in replicas:
            return Ranking([holder, *[r for r in replicas if r != holder]], "session")
        kv = await self.score(prompt) if prompt is not None else KVScores()
        pick = pick_replica(list(replicas), kv.scores, kv.num_blocks, loads, self.weights, self._turn, key_holder)
        return Ranking(pick.ranking, pick.reason, pick.kv_blocks)

    async def score(self, prompt: Prompt) -> KVScores:
        """KV scores of ``prompt`` (tokenized off the event loop when long); empty before any
        replica stated its facts, or for a body the tokenizer or template refuses."""
        indexer = await self.indexer()
        if indexer is None:
            return KVScores()
        try:
            return await indexer.score(prompt)
        except Exception as exc:  # noqa: BLE001 - a body the replica will refuse: routed by load
            logger.debug("no KV score for this request: %s", exc)
            return KVScores()

    async def indexer(self) -> KVCacheIndexer | None:
        """The indexer, built on first use from the facts (the tokenizer loads on a thread)."""
        if self._indexer is not None or self.facts is None:
            return self._indexer
        async with self._indexer_lock:
            if self._indexer is None:
                facts = self.facts
                tokenizer = await asyncio.to_thread(self._load_tokenizer, facts.model_path)
                prompts = PromptTokenizer(tokenizer, workers=1)
                self._indexer = KVCacheIndexer(prompts, self.index, self.scorer, self.tiers, facts.block_size,
                                               root_hash(facts.hash_seed, facts.fingerprint))
        return self._indexer
