"""Scoring replicas: KV block scorers (llm-d's KVBlockScorer), tier weights, and the final pick.

A KV scorer turns an index lookup (for each prompt block in order: replica -> fastest medium holding
it) into replica -> score in blocks, each hit counted by the worth of its tier. The pick combines
that with load; see ``RoutingWeights`` for the formula.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from types import MappingProxyType
from typing import Protocol

from kvhive.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_REMOTE

Hits = Sequence[Mapping[str, str]]
_TIER_ATTR = MappingProxyType({MEDIUM_GPU: "gpu", MEDIUM_CPU: "cpu", MEDIUM_DISK: "disk",
                               MEDIUM_REMOTE: "remote"})


@dataclass(frozen=True)
class TierWeights:
    """What a cached block is worth by the tier holding it: a device block saves the most work."""

    gpu: float = 1.0
    cpu: float = 0.8
    disk: float = 0.5
    remote: float = 0.3

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk", "remote"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"tier weight {name} must be in [0, 1], got {getattr(self, name)}")

    def of(self, medium: str) -> float:
        """The weight of a hit in ``medium`` (a MEDIA name)."""
        return getattr(self, _TIER_ATTR.get(medium, "remote"))


class KVBlockScorer(Protocol):
    """Replica -> score in (tier-weighted) blocks, from the index lookup of a prompt's block keys."""

    def score(self, hits: Hits, tiers: TierWeights) -> dict[str, float]:
        """Scores of the replicas that hold anything; a replica left out scores 0."""
        ...


def runs(hits: Hits) -> Iterator[tuple[Mapping[str, str], int]]:
    """(holders, n) for each run of n consecutive blocks with the very same holders object. Indexes
    share one holders object per set of holders, so a long prompt is a few runs, not one per block."""
    for _, run in groupby(hits, key=id):
        blocks = list(run)
        yield blocks[0], len(blocks)


class LongestPrefixMatch:
    """The weighted length of the unbroken run of blocks, from block 0, that one replica holds."""

    def score(self, hits: Hits, tiers: TierWeights) -> dict[str, float]:
        """Sum of tier weights over each replica's leading run of hits."""
        scores: dict[str, float] = {}
        running: set[str] | None = None     # replicas whose run is unbroken so far
        for holders, n in runs(hits):
            running = set(holders) if running is None else running & holders.keys()
            if not running:
                break
            for replica in running:
                scores[replica] = scores.get(replica, 0.0) + n * tiers.of(holders[replica])
        return scores


class HighestBlockHit:
    """The position (1-based) of the last block a replica holds, weighted by that block's tier."""

    def score(self, hits: Hits, tiers: TierWeights) -> dict[str, float]:
        """(index + 1) * tier weight of each replica's highest hit."""
        scores: dict[str, float] = {}
        end = 0
        for holders, n in runs(hits):
            end += n
            for replica, medium in holders.items():
                scores[replica] = end * tiers.of(medium)
        return scores


class CoverageBasedMatching:
    """How many of the prompt's blocks a replica holds anywhere, each weighted by its tier."""

    def score(self, hits: Hits, tiers: TierWeights) -> dict[str, float]:
        """Sum of tier weights over all of each replica's hits."""
        scores: dict[str, float] = {}
        for holders, n in runs(hits):
            for replica, medium in holders.items():
                scores[replica] = scores.get(replica, 0.0) + n * tiers.of(medium)
        return scores


SCORERS: Mapping[str, type[KVBlockScorer]] = MappingProxyType({
    "longest_prefix": LongestPrefixMatch,
    "highest_block": HighestBlockHit,
    "coverage": CoverageBasedMatching,
})


@dataclass(frozen=True)
class LoadStats:
    """A replica's load: requests running and waiting, and the fraction of its KV pool in use."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class RoutingWeights:
    """How the pick weighs cache against load. For each candidate replica r::

        final(r) = cache    * share(r)                            (share of the prompt cached, 0..1)
                 - load     * queue(r) / (1 + max_r' queue(r'))   (relative queue length, 0..1)
                 - kv_usage * usage(r)                            (KV pool in use, 0..1)
                 + cache_key * [r served the request's prompt_cache_key last]
        share(r) = kv(r) / num_blocks, or 0 below min_share
        queue(r) = running(r) + waiting_factor * waiting(r)

    The highest final score wins; equal scores are broken round-robin. ``min_share`` keeps a small
    common prefix (a chat template's system prompt, a few blocks of a long prompt) from drawing
    every new prompt to the replica that holds it: below it, load and pool usage decide.
    ``cache_key`` keeps a ``prompt_cache_key`` on its replica while load allows: with the defaults,
    until that replica's queue is 4 or more while the others are idle.
    """

    cache: float = 1.0
    load: float = 0.5
    kv_usage: float = 0.1
    waiting_factor: float = 2.0
    min_share: float = 0.1
    cache_key: float = 0.4

    def __post_init__(self) -> None:
        for name in ("cache", "load", "kv_usage", "waiting_factor", "min_share", "cache_key"):
            problem = weight_problem(name, getattr(self, name))
            if problem is not None:
                raise ValueError(f"routing weight {name} {problem}")


# The largest routing weight: scores stay finite whatever they are summed with.
MAX_WEIGHT = 1e6


def weight_problem(name: str, value: float) -> str | None:
    """What is wrong with ``value`` for RoutingWeights field ``name`` ("must be >= 0, got -1"), or None."""
    if not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if value < 0:
        return f"must be >= 0, got {value}"
    if value > MAX_WEIGHT:
        return f"must be <= {MAX_WEIGHT:g}, got {value}"
    if name == "min_share" and value > 1:
        return f"must be <= 1, got {value}"
    return None


@dataclass(frozen=True)
class Pick:
    """The chosen replica, every candidate's final score, the chosen one's KV score in blocks, and
    whether it is the replica that answered the request's prompt_cache_key last (with a bonus)."""

    replica: str
    ranking: list[str]
    scores: dict[str, float] = field(default_factory=dict)
    kv_blocks: float = 0.0
    key_holder: bool = False

    @property
    def reason(self) -> str:
        """Why the chosen replica is first: "kv" (it holds some of the prompt), "cache_key" (it
        answered the request's prompt_cache_key last), else "load"."""
        return "kv" if self.kv_blocks > 0 else "cache_key" if self.key_holder else "load"


def pick_replica(candidates: Sequence[str], kv_scores: Mapping[str, float], num_blocks: int,
                 loads: Mapping[str, LoadStats], weights: RoutingWeights, turn: int = 0,
                 key_holder: str | None = None) -> Pick:
    """Rank ``candidates`` by ``RoutingWeights``' formula; ``turn`` rotates the order ties resolve in;
    ``key_holder``: the replica that served the request's prompt_cache_key last (None: no key, or
    none known)."""
    if not candidates:
        raise ValueError("pick_replica needs at least one candidate")
    idle = LoadStats()
    queues = {r: loads.get(r, idle).running + weights.waiting_factor * loads.get(r, idle).waiting
              for r in candidates}
    max_queue = max(queues.values())
    scores = {}
    for r in candidates:
        cached = kv_scores.get(r, 0.0) / num_blocks if num_blocks else 0.0
        cached = cached if cached >= weights.min_share else 0.0
        score = (weights.cache * cached - weights.load * queues[r] / (1.0 + max_queue)
                 - weights.kv_usage * loads.get(r, idle).kv_usage
                 + (weights.cache_key if r == key_holder else 0.0))
        scores[r] = round(score, 9)   # equal up to float noise counts as a tie
    start = turn % len(candidates)
    rotated = list(candidates[start:]) + list(candidates[:start])
    ranking = sorted(rotated, key=lambda r: -scores[r])   # stable: ties keep the rotated order
    return Pick(ranking[0], ranking, scores, kv_scores.get(ranking[0], 0.0),
                ranking[0] == key_holder and weights.cache_key > 0)
