"""The replica simulator (bench/replica_sim.py): its KV cache and events, and its gateway policies (no model,
no sockets; its HTTP API: tests/engine/test_router_tokenized.py)."""

from __future__ import annotations

import asyncio

import pytest
from replica_sim import SimConfig, SimKVCache, replica_specs

from kvhive.core.blocks import hash_blocks, root_hash
from kvhive.core.kv_events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvhive.gateway.gateway_config import GatewayConfig, ReplicaSpec
from kvhive.routing.index import InMemoryIndex
from kvhive.routing.ingest import BlockKeyMapper, ReplicaIngest

ROOT = root_hash(0, "simulated-model")


def test_cache_stores_runs_with_parents_and_evicts_the_end_of_a_chain_first() -> None:
    cache = SimKVCache(capacity=6, block_size=4)
    ids = list(range(20))
    keys = hash_blocks(ids, 4, ROOT)
    assert cache.match(keys) == 0
    events = cache.store(keys, ids, 0)
    assert events == [BlockStored(keys, None, ids, 4)]
    assert cache.match(keys) == 5
    # A prompt sharing 2 blocks: its new blocks chain from block 1; capacity 6 evicts 2 blocks, the
    # end of the older chain (a stored chain is touched tail first, so its head is the most recent).
    other = ids[:8] + [99] * 12
    other_keys = hash_blocks(other, 4, ROOT)
    assert cache.match(other_keys) == 2
    events = cache.store(other_keys, other, 2)
    removed, stored = events
    assert stored == BlockStored(other_keys[2:], other_keys[1], other[8:20], 4)
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [keys[4], keys[3]]
    assert len(cache) == 6 and cache.match(other_keys) == 5


def test_events_index_the_blocks_the_gateway_looks_up() -> None:
    cache = SimKVCache(capacity=100, block_size=16)
    ids = list(range(100, 180))
    keys = hash_blocks(ids, 16, ROOT)
    index = InMemoryIndex()
    ingest = ReplicaIngest("http://sim:1", index, BlockKeyMapper(False, 16, ROOT))
    payload = encode_batch(EventBatch(0.0, cache.store(keys, ids, 0)))
    ingest.on_batch(0, payload)
    assert [h["http://sim:1"] for h in index.lookup(keys)] == ["GPU"] * 5
    # A foreign-engine mapper (recomputing keys from token ids) agrees with the announced keys.
    stored = decode_batch(payload).events[0]
    assert BlockKeyMapper(True, 16, ROOT).stored(stored) == keys


def test_gateway_policy_is_validated() -> None:
    replicas = (ReplicaSpec("http://a:1"),)
    assert GatewayConfig(replicas, policy="round_robin").policy == "round_robin"
    with pytest.raises(ValueError, match="--policy"):
        GatewayConfig(replicas, policy="fastest")
    assert replica_specs(2, 9000, 19000) == [
        "http://127.0.0.1:9000,events=tcp://127.0.0.1:19000,replay=tcp://127.0.0.1:19001",
        "http://127.0.0.1:9001,events=tcp://127.0.0.1:19002,replay=tcp://127.0.0.1:19003"]
    with pytest.raises(ValueError):
        SimConfig(capacity_blocks=0)


def test_baseline_policies_ignore_the_index_but_keep_sessions() -> None:
    from kvhive.gateway.gateway import Gateway
    from kvhive.gateway.metrics import GatewayMetrics
    from kvhive.gateway.replicas import Replica, ReplicaSet
    from kvhive.routing.affinity import SessionAffinity
    from kvhive.routing.scorer import RoutingWeights

    names = [f"http://r{i}:1" for i in range(3)]

    def gateway(policy: str) -> Gateway:
        replicas = [Replica(ReplicaSpec(n), healthy=True) for n in names]
        return Gateway(ReplicaSet(replicas, InMemoryIndex(), client=None), indexer=None,
                       sessions=SessionAffinity(), weights=RoutingWeights(), metrics=GatewayMetrics(),
                       client=None, policy=policy, seed=3)

    async def firsts(g: Gateway, n: int, session: str | None = None) -> list[tuple[str, str]]:
        out = []
        for _ in range(n):
            ranked, reason = await g.choose(None, session, "owner-a")
            out.append((ranked[0].name, reason))
        return out

    rr = asyncio.run(firsts(gateway("round_robin"), 6))
    assert [name for name, _ in rr] == names[1:] + names + names[:1] and {r for _, r in rr} == {"round_robin"}
    rnd = asyncio.run(firsts(gateway("random"), 30))
    assert {name for name, _ in rnd} == set(names) and {r for _, r in rnd} == {"random"}
    g = gateway("random")
    g.sessions.remember("owner-a", "s", names[2])
    assert asyncio.run(firsts(g, 5, "s")) == [(names[2], "session")] * 5
    g.sessions.remember("owner-b", "t", names[2])           # another key's id: unknown to owner-a
    assert {reason for _, reason in asyncio.run(firsts(g, 5, "t"))} == {"random"}
