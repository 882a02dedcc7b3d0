"""Hostile bodies (``support.hostile_bodies``) over real HTTP: a tiny replica and a gateway in front
of it answer every one 400 (413 over a limit) in OpenAI's error shape, never a 5xx, and while each
is in flight the same process answers ``GET /health`` on another connection.

The replica gets its bodies at the size of its default limit (1 MiB); the gateway at a few MiB,
parsed whole before it forwards them. The replica's limit is raised to take those too, so a body
the gateway forwards is refused by the replica for what it is (400). Then a normal completion
still works on each.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from support.cluster import Cluster, TinyReplica, running_replicas, start_gateway, stop_gateway
from support.hostile_bodies import hostile_bodies
from support.servers import SERVED_MODEL_NAME, TINY_MAX_MODEL_LEN

from kvhive.gateway.gateway_config import GatewayConfig
from kvhive.server.body_limit import default_max_request_bytes

REPLICA_BODY_BYTES = default_max_request_bytes(TINY_MAX_MODEL_LEN)
GATEWAY_BODY_BYTES = 3 << 20
REPLICA_LIMIT = GATEWAY_BODY_BYTES + 4096
GATEWAY_LIMIT = GatewayConfig.max_request_bytes          # its default
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/context", "/tokenize")
# A probe that waits this long means the process stopped serving (an error, not a measurement).
PROBE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    replica = TinyReplica(extra_args=("--max-request-bytes", str(REPLICA_LIMIT)))
    with running_replicas([replica]) as replicas:
        started = start_gateway(replicas, "--health-interval", "1", "--failures-to-drop", "1000")
        try:
            yield started
        finally:
            stop_gateway(started)


class InFlight:
    """A POST whose body is sent whole and whose response is read only when asked for;
    ``declared`` sends a Content-Length of its own (a body the server refuses unread)."""

    def __init__(self, base_url: str, path: str, body: bytes, declared: int | None = None) -> None:
        url = urlsplit(base_url)
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=PROBE_TIMEOUT_S)
        self.connection.putrequest("POST", path)
        self.connection.putheader("Content-Type", "application/json")
        self.connection.putheader("Content-Length", str(len(body) if declared is None else declared))
        self.connection.endheaders(body)

    def answer(self) -> tuple[int, bytes]:
        """The response's status and body."""
        try:
            response = self.connection.getresponse()
            return response.status, response.read()
        finally:
            self.connection.close()


def assert_refused(status: int, body: bytes, what: str) -> None:
    """400 (or 413) in OpenAI's error shape."""
    assert status in (400, 413), f"{what}: {status} {body[:300]!r}"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str), what
    assert error["code"] == ("request_too_large" if status == 413 else error["code"]), what


def send_all(base_url: str, bodies: dict[str, bytes]) -> dict[str, int]:
    """Each body to each route; /health probed (and answering) while it is in flight. The statuses
    by "route name"."""
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=base_url, timeout=PROBE_TIMEOUT_S) as prober:
        for route in ROUTES:
            for name, body in bodies.items():
                what = f"{route} {name} ({len(body)} bytes)"
                hostile = InFlight(base_url, route, body)
                # The hostile response is read only after the probe's: the probe answered while the
                # hostile request was in flight (a process stuck on the body would not answer).
                probe = prober.get("/health")
                assert probe.status_code == 200, f"/health during {what}: {probe.status_code}"
                status, answer = hostile.answer()
                assert_refused(status, answer, what)
                statuses[f"{route} {name}"] = status
    return statuses


def assert_still_serves(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/completions", timeout=60,
                   json={"model": SERVED_MODEL_NAME, "prompt": "Hello there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_the_replica_refuses_hostile_bodies_and_keeps_serving(cluster: Cluster) -> None:
    replica = cluster.replicas[0].url
    statuses = send_all(replica, hostile_bodies(REPLICA_BODY_BYTES))
    assert set(statuses.values()) == {400}          # all under the limit: each refused for what it is
    too_big = InFlight(replica, "/v1/completions", b'{"prompt": "', declared=REPLICA_LIMIT + 1)
    status, answer = too_big.answer()
    assert status == 413
    assert_refused(status, answer, "over the limit")
    assert_still_serves(replica)


def test_the_gateway_refuses_hostile_bodies_and_keeps_serving(cluster: Cluster) -> None:
    statuses = send_all(cluster.gateway_url, hostile_bodies(GATEWAY_BODY_BYTES))
    # Refused by the gateway (its shape, a lone surrogate) or by the replica (the rest): 400 each.
    assert set(statuses.values()) == {400}
    too_big = InFlight(cluster.gateway_url, "/v1/chat/completions", b'{"messages": "', declared=GATEWAY_LIMIT + 1)
    status, answer = too_big.answer()
    assert status == 413
    assert_refused(status, answer, "over the gateway's limit")
    assert_still_serves(cluster.gateway_url)
    assert set(cluster.replica_states().values()) == {"up"}


def test_a_body_over_the_replica_limit_gets_its_413_through_the_gateway(cluster: Cluster) -> None:
    """The replica answers 413 before reading such a body and closes lingering, so a client (or the
    gateway) still sending it reads the 413 rather than a reset, and the gateway passes it on
    without counting it against the replica."""
    prompt = "hello " * ((16 << 20) // 6)
    body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}).encode()
    assert REPLICA_LIMIT < len(body) < GATEWAY_LIMIT
    for base_url in (cluster.replicas[0].url, cluster.gateway_url):
        status, answer = InFlight(base_url, "/v1/completions", body).answer()
        assert status == 413, (base_url, answer[:300])
        assert_refused(status, answer, f"over the replica's limit via {base_url}")
    details = httpx.get(f"{cluster.gateway_url}/health", timeout=30).json()["details"]
    assert [(d["routing"], d["consecutive_failures"]) for d in details.values()] == [("ok", 0)]
    assert_still_serves(cluster.gateway_url)
