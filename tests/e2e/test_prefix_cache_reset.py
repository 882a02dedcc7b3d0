"""``POST /reset_prefix_cache`` on real processes: the API key and bounded query parameters (tiny
model), and on a default-model replica publishing KV events to a real ZMQ subscriber and to a
``kvhive gateway``: a reset drops the cached prompt and keeps the session's blocks, the stream says
AllBlocksCleared and then exactly what is held, ``reset_external=true`` empties the CPU tier, and the
gateway stops routing the prompt by cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from support.api import assert_error
from support.cluster import ReplicaProcess, long_prompt, running_replicas, start_gateway, stop_gateway
from support.kv_event_decoders import replay_from, vllm_decode
from support.servers import (
    SERVED_MODEL_NAME,
    ServerProcess,
    metric_samples,
    start_server,
    stop_server,
    wait_until,
)

KEY = "reset-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[ServerProcess]:
    server = start_server("tiny", api_keys=(KEY,), extra_args=("--cpu-offload-gb", "0.01"))
    yield server
    stop_server(server)


def test_a_reset_needs_the_api_key_and_says_what_it_dropped(tiny_server: ServerProcess) -> None:
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as c:
        assert_error(c.post("/reset_prefix_cache"), 401, code="invalid_api_key")
        body = {"model": SERVED_MODEL_NAME, "prompt": list(range(10, 60)), "max_tokens": 2}
        assert c.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        r = c.post("/reset_prefix_cache", headers=AUTH)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"dropped_blocks", "kept_blocks"}
        assert r.json()["dropped_blocks"]["device"] > 0 and r.json()["kept_blocks"]["device"] == 0
        r = c.post("/reset_prefix_cache?reset_external=true&reset_running_requests=false", headers=AUTH)
        assert r.status_code == 200 and set(r.json()["dropped_blocks"]) == {"device", "cpu"}
        assert r.json()["kept_blocks"] == {"device": 0, "cpu": 0}


@pytest.mark.parametrize("query,param,says", [
    ("reset_external=maybe", "reset_external", "expected true or false"),
    ("reset_external=", "reset_external", "expected true or false"),
    ("tiers=true", "tiers", "Unknown query parameter"),
    ("reset_external=true&reset_external=false", "reset_external", "more than once"),
    ("reset_running_requests=true", "reset_running_requests", "not supported"),
    ("x" * 5000 + "=1", "x" * 40, "Unknown query parameter"),
])
def test_bad_query_parameters_are_400s(tiny_server: ServerProcess, query: str, param: str, says: str) -> None:
    r = httpx.post(f"{tiny_server.base_url}/reset_prefix_cache?{query}", headers=AUTH, timeout=30)
    assert_error(r, 400, param=param, contains=(says,))
    assert len(r.text) < 1000


def events_from(ctx: zmq.Context, replay: str) -> list[Any]:
    """Every batch the replica published, decoded as vLLM's structs decode them (map encoding)."""
    return [vllm_decode(payload, array_like=False) for _, payload in replay_from(ctx, replay, 0)]


def view(batches: list[Any]) -> dict[str, set[bytes]]:
    """Medium -> block hashes, for a consumer that applies every batch in order."""
    held: dict[str, set[bytes]] = {}
    for batch in batches:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                held = {}
            elif kind == "BlockStored":
                held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                held.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return held


def last_reset(batches: list[Any]) -> list[Any] | None:
    """The events of the last batch after the first one that starts with AllBlocksCleared (None: none)."""
    resets = [b for b in batches[1:] if b.events and type(b.events[0]).__name__ == "AllBlocksCleared"]
    return resets[-1].events if resets else None


def complete(url: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_reset_replica_restates_what_it_holds_and_the_gateway_routes_by_it() -> None:
    replica = ReplicaProcess(extra_args=("--cpu-offload-gb", "0.05"))
    prompt, session_prompt = long_prompt(301, words=60), long_prompt(302, words=60)
    ctx = zmq.Context()
    with running_replicas([replica]):
        cluster = start_gateway([replica])
        replay = f"tcp://127.0.0.1:{replica.replay_port}"
        try:
            assert cached(complete(cluster.gateway_url, prompt)) == 0
            wait_until(lambda: complete(cluster.gateway_url, prompt).headers["x-kvhive-route-reason"] == "kv",
                       60, "the gateway to index the prompt")
            r = httpx.post(f"{replica.url}/v1/context", headers={"x-session-ttl": "600"}, timeout=120, json={
                "model": SERVED_MODEL_NAME, "prompt": session_prompt, "max_tokens": 1, "temperature": 0})
            assert r.status_code == 200, r.text
            session = {"x-session-id": r.headers["x-session-id"]}
            wait_until(lambda: sum(metric_samples(httpx.get(f"{replica.url}/metrics").text,
                                                  "kvhive_kv_tier_bytes_in_total", {"tier": "cpu"})) > 0,
                       60, "the CPU tier to save blocks")

            r = httpx.post(f"{replica.url}/reset_prefix_cache", timeout=60)
            assert r.status_code == 200, r.text
            dropped, kept = r.json()["dropped_blocks"], r.json()["kept_blocks"]
            assert dropped["device"] > 0 and kept["device"] >= 3 and set(kept) == {"device", "cpu"}
            wait_until(lambda: last_reset(events_from(ctx, replay)) is not None, 10, "the reset's batch")
            batches = events_from(ctx, replay)
            device = [e for e in last_reset(batches) if type(e).__name__ == "BlockStored" and e.medium == "GPU"]
            session_ids = httpx.post(f"{replica.url}/tokenize", json={"prompt": session_prompt}).json()["tokens"]
            assert device[0].parent_block_hash is None
            assert [t for e in device for t in e.token_ids] == session_ids[:16 * kept["device"]]
            held = view(batches)                      # applied in order: exactly what the replica holds
            assert (len(held["GPU"]), len(held.get("CPU", ()))) == (kept["device"], kept["cpu"]) and kept["cpu"] > 0

            r = httpx.post(f"{replica.url}/reset_prefix_cache?reset_external=true", timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["dropped_blocks"]["cpu"] > 0
            kept = r.json()["kept_blocks"]
            wait_until(lambda: len(view(events_from(ctx, replay)).get("CPU", ())) == kept["cpu"], 10,
                       "the stream to show the emptied CPU tier")
            assert len(view(events_from(ctx, replay))["GPU"]) == kept["device"]

            again = complete(cluster.gateway_url, prompt)
            assert again.headers["x-kvhive-route-reason"] == "load" and cached(again) == 0

            # Through the gateway: passed on to every replica, its refusals answered as they are.
            assert_error(httpx.post(f"{cluster.gateway_url}/reset_prefix_cache?reset_external=maybe", timeout=60),
                         400, param="reset_external")
            assert cached(complete(cluster.gateway_url, prompt)) > 0
            r = httpx.post(f"{cluster.gateway_url}/reset_prefix_cache?reset_external=true", timeout=60)
            assert r.status_code == 200, r.text
            assert list(r.json()["replicas"]) == [replica.url]
            assert r.json()["replicas"][replica.url]["dropped_blocks"]["cpu"] > 0
            assert cached(complete(replica.url, prompt)) == 0
            turn = complete(replica.url, session_prompt + " And then the story goes on.", headers=session)
            assert cached(turn) >= 16 * 3
        finally:
            stop_gateway(cluster)
            ctx.term()
