"""HTTP limits before a request reaches the app, over raw sockets, on a replica process and on a
gateway process in front of it, each started with small ``--http-*`` limits: a head too large or
with too many fields is 431, a head that stalls 408, an idle kept-alive connection is closed, a
connection over the cap is 503 while open and freed slots keep working, and a stream that outlasts
both timeouts completes. Flags and bounds in process: tests/unit/test_http_limit_flags.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from support.api import chat_body
from support.cluster import Cluster, TinyReplica, running_replicas, start_gateway, stop_gateway
from support.raw_http import (
    HEALTH_REQUEST,
    closed_by_server,
    connect,
    flood_until_answered,
    read_response,
)
from support.servers import SLOW_MARKER, read_sse, wait_until

MAX_HEADER_BYTES = 8192
MAX_HEADERS = 20
MAX_CONNECTIONS = 6
TIMEOUT_S = 1.0             # both the head timeout and the keep-alive timeout
LIMITS = ("--http-max-header-bytes", str(MAX_HEADER_BYTES), "--http-max-headers", str(MAX_HEADERS),
          "--http-header-timeout", str(TIMEOUT_S), "--http-keep-alive-timeout", str(TIMEOUT_S),
          "--http-max-connections", str(MAX_CONNECTIONS))
# What a server may read past the head limit before it answers (one socket read, 256 KiB in
# asyncio) plus what the kernel queues between the two ends, generously: far below the flood.
SLACK_BYTES = 8 * 2**20
FLOOD_BYTES = 256 * 2**20


@pytest.fixture(scope="module")
def replica() -> Iterator[TinyReplica]:
    """The tiny test server (``--faulty``: SLOW_MARKER prompts stream slowly) under LIMITS."""
    with running_replicas([TinyReplica(extra_args=("--faulty", *LIMITS))]) as (server,):
        yield server


@pytest.fixture(scope="module")
def gateway(replica: TinyReplica) -> Iterator[Cluster]:
    """A gateway under LIMITS in front of ``replica``; the cap test fills the replica's slots, so
    the gateway's health checks that meet a 503 then must not drop it."""
    cluster = start_gateway([replica], *LIMITS, "--failures-to-drop", "1000")
    try:
        yield cluster
    finally:
        stop_gateway(cluster)


@pytest.fixture(params=["replica", "gateway"])
def url(request: pytest.FixtureRequest) -> str:
    """The base URL of the replica, then of the gateway."""
    if request.param == "replica":
        return request.getfixturevalue("replica").url
    return request.getfixturevalue("gateway").gateway_url


def test_an_endless_header_stops_at_the_limit_with_431(url: str) -> None:
    with contextlib.closing(connect(url)) as sock:
        sent = flood_until_answered(sock, b"GET /health HTTP/1.1\r\nHost: test\r\nX-Endless: ",
                                    b"a" * 4096, FLOOD_BYTES)
        response = read_response(sock)
        assert response.status == 431 and response.headers["connection"] == "close"
        assert closed_by_server(sock)
    assert sent <= MAX_HEADER_BYTES + SLACK_BYTES


def _head(num_fields: int) -> bytes:
    """A GET /health head with ``num_fields`` header fields, Host included."""
    return (b"GET /health HTTP/1.1\r\nHost: test\r\n"
            + b"".join(b"X-Field-%d: v\r\n" % i for i in range(num_fields - 1)) + b"\r\n")


def test_too_many_header_fields_are_431(url: str) -> None:
    with contextlib.closing(connect(url)) as sock:
        sock.sendall(_head(MAX_HEADERS))
        assert read_response(sock).status == 200
        sock.sendall(_head(MAX_HEADERS + 1))
        response = read_response(sock)
        assert response.status == 431 and b"header fields" in response.body
        assert closed_by_server(sock)


def test_a_head_that_stalls_is_408_and_closed(url: str) -> None:
    with contextlib.closing(connect(url)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: te")
        response = read_response(sock)
        assert response.status == 408 and response.headers["connection"] == "close"
        assert closed_by_server(sock)


def test_a_silent_connection_is_408_and_closed(url: str) -> None:
    with contextlib.closing(connect(url)) as sock:
        assert read_response(sock).status == 408
        assert closed_by_server(sock)


def test_an_idle_kept_alive_connection_is_closed(url: str) -> None:
    with contextlib.closing(connect(url)) as sock:
        sock.sendall(HEALTH_REQUEST)
        assert read_response(sock).status == 200
        sock.sendall(HEALTH_REQUEST)                        # kept alive: a second request is served
        response = read_response(sock)
        assert response.status == 200 and response.headers.get("connection") != "close"
        assert closed_by_server(sock)                       # then idle: closed, no response sent


def test_connections_over_the_cap_get_503_and_freed_slots_serve(url: str) -> None:
    socks = [connect(url) for _ in range(MAX_CONNECTIONS + 2)]
    try:
        for sock in socks:
            sock.sendall(HEALTH_REQUEST)
        responses = [read_response(sock) for sock in socks]
        statuses = [r.status for r in responses]
        assert statuses.count(503) >= 2 and 200 in statuses, statuses
        for sock, response in zip(socks, responses, strict=True):
            if response.status == 503:
                assert response.headers["connection"] == "close" and closed_by_server(sock)
            else:
                assert response.status == 200
                sock.sendall(HEALTH_REQUEST)            # an open slot keeps serving
                assert read_response(sock).status == 200
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: _health_on_a_new_connection(url) == 200, 30, "a freed slot to serve /health")


def _health_on_a_new_connection(url: str) -> int:
    with contextlib.closing(connect(url)) as sock:
        try:
            sock.sendall(HEALTH_REQUEST)
            return read_response(sock).status
        except (AssertionError, OSError):
            return 0


def test_a_stream_longer_than_both_timeouts_completes(url: str) -> None:
    # At least 20 ms per token (SLOW_MARKER): 120 tokens take 2.4 s, more than both timeouts together.
    body = chat_body("Tell a long story " + SLOW_MARKER, max_tokens=120, stream=True, ignore_eos=True,
                     temperature=0)
    with httpx.Client(base_url=url, timeout=120) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert all("error" not in e for e in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in chunks if e["choices"] and e["choices"][0]["delta"].get("content")) > 60


def test_the_limits_leave_ordinary_clients_alone(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200

