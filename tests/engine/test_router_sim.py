"""The replica simulator (bench/replica_sim.py): its KV cache and events, and its HTTP API (no model,
no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from replica_sim import SimConfig, SimKVCache, SimReplica, create_sim_app, replica_specs

from kvhive.core.blocks import hash_blocks, root_hash
from kvhive.kv.events import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch
from kvhive.router.config import GatewayConfig, ReplicaSpec
from kvhive.router.index import InMemoryIndex
from kvhive.router.ingest import BlockKeyMapper, ReplicaIngest
from kvhive.router.replicas import parse_load
from kvhive.router.tokenize import PromptTokenizer

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


@pytest.fixture(scope="module")
def prompts() -> PromptTokenizer:
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer

    return PromptTokenizer(Tokenizer.from_model_path(default_model_path()), workers=1)


def test_http_api_reports_cached_tokens_load_and_hashing(prompts: PromptTokenizer) -> None:
    config = SimConfig(capacity_blocks=64, prefill_ms_per_token=0.01, decode_ms_per_token=1.0)
    replica = SimReplica(config, prompts, publisher=None)
    app = create_sim_app(replica)
    text = "The quick brown fox jumps over the lazy dog. " * 20

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            card = (await client.get("/v1/models")).json()["data"][0]
            assert (card["kvhive_fingerprint"], card["kvhive_block_size"], card["kvhive_hash_seed"]) == \
                (config.fingerprint, 16, 0)
            body = {"model": "m", "prompt": text, "max_tokens": 3}
            first = (await client.post("/v1/completions", json=body)).json()
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert first["usage"]["completion_tokens"] == 3
            second = (await client.post("/v1/completions", json=body)).json()
            n = first["usage"]["prompt_tokens"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
            chat = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
                    "stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post("/v1/chat/completions", json=chat)
            lines = [x[6:] for x in streamed.text.splitlines() if x.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            chunks = [json.loads(x) for x in lines[:-1]]
            assert [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]] == [" tok"] * 2
            assert chunks[-1]["usage"]["completion_tokens"] == 2
            load = parse_load((await client.get("/metrics")).text)
            assert load.running == 0 and load.waiting == 0 and 0 < load.kv_usage <= 1
            bad = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

    asyncio.run(scenario())
    # The replica hashed the prompt as the gateway does: its blocks are the gateway's keys.
    ids = prompts.encode(text)
    keys = hash_blocks(ids, 16, root_hash(0, config.fingerprint))
    assert replica.cache.match(keys) == len(keys)


def test_baseline_policies_ignore_the_index_but_keep_sessions() -> None:
    from kvhive.router.gateway import Gateway
    from kvhive.router.metrics import GatewayMetrics
    from kvhive.router.replicas import Replica, ReplicaSet
    from kvhive.router.scorer import RoutingWeights
    from kvhive.router.sessions import SessionAffinity

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
