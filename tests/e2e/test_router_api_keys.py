"""A gateway in front of a replica with API keys (real processes): per-key salts, per-key routing.

The replica runs ``kvhive serve --api-key A --api-key B`` (no ``--share-prefix-cache``), so it salts
each request's blocks with a digest of the caller's key. A gateway started with
``--salt-with-api-key`` computes the same salt from the Authorization header and finds the blocks in
its index; one without it looks up unsalted keys and falls back to load.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from support.cluster import (
    Cluster,
    ReplicaProcess,
    long_prompt,
    running_replicas,
    start_gateway,
    stop_gateway,
)
from support.servers import SERVED_MODEL_NAME, wait_until

from kvhive.gateway.cli import fetch_hashing
from kvhive.gateway.gateway_config import ReplicaSpec

KEYS = ("key-alpha", "key-beta")


@pytest.fixture(scope="module")
def gateways() -> Iterator[tuple[Cluster, Cluster]]:
    replica = ReplicaProcess(extra_args=("--api-key", KEYS[0], "--api-key", KEYS[1]))
    flags = ("--replica-api-key", KEYS[0], "--health-interval", "0.3")
    with running_replicas([replica], print_logs=False):
        started: list[Cluster] = []
        try:
            started.append(start_gateway([replica], *flags, "--salt-with-api-key", until_all_up=False))
            started.append(start_gateway([replica], *flags, until_all_up=False))
            yield started[0], started[1]
        finally:
            for cluster in started:
                stop_gateway(cluster)


def complete(cluster: Cluster, prompt: str, key: str, **extra: object) -> httpx.Response:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    response = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_same_key_routes_by_kv_and_other_keys_do_not_share(gateways: tuple[Cluster, Cluster]) -> None:
    salted, plain = gateways
    prompt = long_prompt(7)                     # ~15 full blocks
    first = complete(salted, prompt, KEYS[0])
    assert first.headers["x-kvhive-route-reason"] == "load"
    wait_until(lambda: salted.metric("kvhive_gateway_index_keys") >= 12, 10,
               "KV events to reach the salted gateway's index")
    again = complete(salted, prompt, KEYS[0])
    assert again.headers["x-kvhive-route-reason"] == "kv"          # an index hit under key A's salt
    assert cached_tokens(again) > 0
    # Key B: neither the gateway's index nor the replica's cache offers key A's blocks.
    other = complete(salted, prompt, KEYS[1])
    assert other.headers["x-kvhive-route-reason"] == "load"
    assert cached_tokens(other) == 0
    # Key A with a body cache_salt is yet another tenant of the cache.
    assert complete(salted, prompt, KEYS[0], cache_salt="s").headers["x-kvhive-route-reason"] == "load"
    # A gateway that does not salt with the key looks up unsalted keys: it never finds them.
    wait_until(lambda: plain.metric("kvhive_gateway_index_keys") >= 12, 10, "events at the plain gateway")
    assert complete(plain, prompt, KEYS[0]).headers["x-kvhive-route-reason"] == "load"


def test_block_hash_settings_are_read_with_the_replica_key(gateways: tuple[Cluster, Cluster]) -> None:
    spec = (ReplicaSpec.parse(gateways[0].replicas[0].spec),)
    learned = fetch_hashing(spec, wait_s=5, api_key=KEYS[1])
    assert learned.fingerprint and learned.block_size == 16
    refused = fetch_hashing(spec, wait_s=5)            # 401: given up at once, not retried
    assert refused.fingerprint is None and refused.block_size is None
