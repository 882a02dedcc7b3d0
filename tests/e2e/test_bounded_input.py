"""Bounded input: a body over --max-request-bytes is a 413 in OpenAI's shape before it is read, and
neither a rejected maximal body nor a just-under-the-limit prompt being tokenized holds up the
event loop (``/health`` keeps answering).

The shared tiny server over real sockets (its default limit: ``default_max_request_bytes`` of its
512-token context, 1 MiB); the middleware in process: tests/unit/test_body_limit.py.
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from support.servers import TINY_API_KEY, TINY_MAX_MODEL_LEN, ServerProcess

from kvhive.server.body_limit import default_max_request_bytes

MODEL = "smollm2-135m"
LIMIT = default_max_request_bytes(TINY_MAX_MODEL_LEN)
# /health must answer within this while the server rejects or tokenizes big bodies (loose for CI's
# shared cores; the figures measured are printed).
HEALTH_BOUND_S = 1.0


def raw_exchange(base_url: str, head: bytes, body_parts: list[bytes], timeout_s: float = 30.0) -> tuple[int, bytes]:
    """Send ``head`` and ``body_parts`` on a fresh connection and read one response; (status, body).
    A server that answers before the body is sent whole may close the connection meanwhile: the
    parts left are then not sent."""
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        with contextlib.suppress(ConnectionResetError):     # closed with body bytes left unread
            while b"\r\n\r\n" not in data or len(data) < response_end(data):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    header, _, body = data.partition(b"\r\n\r\n")
    return int(header.split(b" ", 2)[1]), body


def response_end(data: bytes) -> int:
    """The length of the response whose head ``data`` starts with (its Content-Length body after it)."""
    header, _, _ = data.partition(b"\r\n\r\n")
    for line in header.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(header) + 4 + int(value)
    raise AssertionError(f"a response without Content-Length: {header!r}")


def request_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {TINY_API_KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def declared_too_large(base_url: str) -> tuple[int, bytes]:
    """A maximal body by Content-Length (limit + 1): only its first 64 KiB are sent; the 413 must
    come without the rest."""
    head = request_head("/v1/completions", f"Content-Length: {LIMIT + 1}\r\n")
    return raw_exchange(base_url, head, [b" " * 65536])


def chunked_too_large(base_url: str) -> tuple[int, bytes]:
    """limit + 1 body bytes in 64 KiB chunks and a last one of 1 byte, without a length; the
    terminating chunk never comes."""
    head = request_head("/v1/chat/completions", "Transfer-Encoding: chunked\r\n")
    sizes = [65536] * (LIMIT // 65536) + [LIMIT % 65536 + 1]
    return raw_exchange(base_url, head, [b"%x\r\n%s\r\n" % (n, b" " * n) for n in sizes])


def assert_413(status: int, body: bytes) -> None:
    assert status == 413, body[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


def test_oversized_bodies_are_413_in_openai_shape(tiny_server: ServerProcess) -> None:
    start = time.monotonic()
    assert_413(*declared_too_large(tiny_server.base_url))
    assert time.monotonic() - start < 5            # the 413 did not wait for the missing ~1 MiB
    assert_413(*chunked_too_large(tiny_server.base_url))
    # Unauthorized: 401 first, the body unread either way.
    url = urlsplit(tiny_server.base_url)
    status, _ = raw_exchange(tiny_server.base_url, (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
                                                    f"Content-Length: {LIMIT + 1}\r\n\r\n").encode(), [])
    assert status == 401


def just_under_limit_bodies() -> list[dict[str, Any]]:
    """A completion and a chat body of about LIMIT - 1 KiB: ~200,000 tokens of text to tokenize
    (far over the 512-token context, so each ends as a 400 after tokenizing)."""
    text = ("All work and no play makes a dull server. " * (LIMIT // 40))[:LIMIT - 1024]
    bodies = [{"model": MODEL, "prompt": text, "max_tokens": 1},
              {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}]
    for body in bodies:
        assert LIMIT - 2048 < len(json.dumps(body)) < LIMIT
    return bodies


class HealthProbe:
    """Times GET /health, back to back, while the load runs."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: list[float] = []

    def run_until(self, done: threading.Event) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            client.get("/health")                   # connect once, outside the measurement
            while not done.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.005)

    def summary(self) -> str:
        ms = sorted(x * 1000 for x in self.latencies)
        return (f"{len(ms)} probes: p50 {statistics.median(ms):.1f} ms, p99 {ms[int(0.99 * (len(ms) - 1))]:.1f} ms, "
                f"max {ms[-1]:.1f} ms")


def under_load(base_url: str, load: Any, rounds: int) -> HealthProbe:
    """Run ``load`` ``rounds`` times while probing /health; the probe with its latencies."""
    probe, done = HealthProbe(base_url), threading.Event()
    prober = threading.Thread(target=probe.run_until, args=(done,))
    prober.start()
    try:
        time.sleep(0.2)                             # probes of the quiet server come first
        for _ in range(rounds):
            load()
    finally:
        done.set()
        prober.join()
    return probe


def test_health_answers_while_maximal_bodies_are_rejected(tiny_server: ServerProcess) -> None:
    def reject_both() -> None:
        assert_413(*declared_too_large(tiny_server.base_url))
        assert_413(*chunked_too_large(tiny_server.base_url))

    probe = under_load(tiny_server.base_url, reject_both, rounds=5)
    print(f"/health while maximal bodies are rejected: {probe.summary()}")
    assert len(probe.latencies) >= 10
    assert max(probe.latencies) < HEALTH_BOUND_S, probe.summary()


def test_health_answers_while_a_large_prompt_is_tokenized(tiny_client: httpx.Client,
                                                          tiny_server: ServerProcess) -> None:
    bodies = just_under_limit_bodies()
    tokenize_s: list[float] = []

    def send_both() -> None:
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            start = time.perf_counter()
            r = tiny_client.post(path, content=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
            tokenize_s.append(time.perf_counter() - start)
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"]["code"] == "context_length_exceeded"

    probe = under_load(tiny_server.base_url, send_both, rounds=2)
    print(f"/health while ~{LIMIT // 1024} KiB prompts are tokenized ({', '.join(f'{s:.2f}' for s in tokenize_s)} s "
          f"each): {probe.summary()}")
    assert len(probe.latencies) >= 10
    assert max(probe.latencies) < HEALTH_BOUND_S, probe.summary()
