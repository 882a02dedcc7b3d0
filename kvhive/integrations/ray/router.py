"""``KVAwareRequestRouter``: Ray Serve's request router for kvhive replicas (``RequestRouterConfig``'s
``request_router_class``).

Ray calls ``choose_replicas`` in the caller's process (the ingress) with the live replicas and the
pending request, whose first argument is an ``HTTPEnvelope``. The ranking is ``ReplicaRouting``'s:
the session's holder, then KV score (kvhive's index fed by each replica's KV events, endpoints from
its metadata) and the replica of the request's prompt_cache_key against load (Ray's queue-length cache and each replica's routing stats). Each
replica is a rank of its own, so Ray tries them in that order and skips a full one. A dead replica
leaves the index at once (``on_replica_actor_died``).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvhive.core.json_body import off_loop_for
from kvhive.integrations.ray.envelope import HTTPEnvelope
from kvhive.integrations.ray.replica_routing import ReplicaFacts, ReplicaRouting
from kvhive.routing.scorer import LoadStats, RoutingWeights, TierWeights

logger = logging.getLogger(__name__)


class KVAwareRequestRouter(RequestRouter):
    """Routes each request to the replica holding its session, else its cached prefix, weighed
    against load (kvhive's scorers, shared with ``kvhive gateway``)."""

    def initialize_state(self, scorer: str = "longest_prefix", tier_weights: dict[str, float] | None = None,
                         routing_weights: dict[str, float] | None = None, salt_with_api_key: bool = False,
                         index_redis_url: str | None = None, **_: Any) -> None:
        """Build the routing state from ``request_router_kwargs`` (the block index in memory, or in
        the Redis at ``index_redis_url``, as ``kvhive gateway --redis-url`` keeps it)."""
        index = None
        if index_redis_url:
            from kvhive.routing.redis_link import GuardedIndex, RedisLink

            index = GuardedIndex(RedisLink(index_redis_url))
        self.routing = ReplicaRouting(scorer, TierWeights(**(tier_weights or {})),
                                      RoutingWeights(**(routing_weights or {})), index)
        self.salt_with_api_key = salt_with_api_key
        self.reasons: dict[str, int] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Follow new replicas' KV events; forget replicas that left."""
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for replica in replicas:
            self.routing.add_replica(replica.replica_id.unique_id,
                                     ReplicaFacts.from_metadata(replica.replica_metadata))
        for gone in set(self.routing.ingests) - live:
            self.routing.drop_replica(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Drop the dead replica and every block the index says it held."""
        super().on_replica_actor_died(replica_id)
        self.routing.drop_replica(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """One rank per candidate, best first (see the module docstring)."""
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        envelope = _envelope(pending_request)
        prompt, holder, key_holder = None, None, None
        if envelope is not None:
            prompt = await off_loop_for(envelope.body, lambda: envelope.routing_prompt(envelope.json_body(),
                                                                                        self.salt_with_api_key))
            holder, key_holder = envelope.holder, envelope.key_holder
        ranking = await self.routing.rank(list(by_id), prompt, holder, self.loads(candidate_replicas),
                                          key_holder)
        self.reasons[ranking.reason] = self.reasons.get(ranking.reason, 0) + 1
        logger.debug("routed %s: %s", ranking.reason, ranking.replicas)
        return [[by_id[name]] for name in ranking.replicas]

    def loads(self, replicas: list[RunningReplica]) -> dict[str, LoadStats]:
        """Each replica's load: requests in flight from Ray's queue-length cache (else its stats),
        waiting requests and KV usage from its routing stats."""
        loads = {}
        for replica in replicas:
            stats = replica.routing_stats or {}
            queued = self.replica_queue_len_cache.get(replica.replica_id)
            running = float(queued if queued is not None else stats.get("running", 0.0))
            loads[replica.replica_id.unique_id] = LoadStats(running, float(stats.get("waiting", 0.0)),
                                                            float(stats.get("kv_usage", 0.0)))
        return loads


def _envelope(pending_request: PendingRequest | None) -> HTTPEnvelope | None:
    """The request's ``HTTPEnvelope`` (its first argument), or None."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, HTTPEnvelope) else None
