"""The request body limit in process: the default fits a context, the flag takes a positive byte
count, and the middleware answers 413 in OpenAI's shape without reading a byte past the limit."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvhive.cli import parse_args
from kvhive.server.body_limit import MIB, BodyLimitMiddleware, BodyTooLarge, default_max_request_bytes


def test_the_default_limit_fits_a_context() -> None:
    assert default_max_request_bytes(512) == MIB
    assert default_max_request_bytes(16384) == MIB
    assert default_max_request_bytes(131072) == 8 * MIB


def test_the_flag_takes_a_positive_byte_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["serve"]).max_request_bytes is None
    assert parse_args(["serve", "--max-request-bytes", "4096"]).max_request_bytes == 4096
    for bad in ("0", "-1", "1MB"):
        with pytest.raises(SystemExit) as exited:
            parse_args(["serve", "--max-request-bytes", bad])
        assert exited.value.code == 2
    assert "--max-request-bytes" in capsys.readouterr().err


class Recorder:
    """An ASGI exchange: the request's body messages handed out, what was sent back, and how
    much the app behind the middleware read."""

    def __init__(self, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> None:
        self.scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        self.chunks = list(chunks)
        self.handed_out = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.chunks:
            return {"type": "http.disconnect"}
        chunk = self.chunks.pop(0)
        self.handed_out += 1
        return {"type": "http.request", "body": chunk, "more_body": bool(self.chunks)}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    def body(self) -> dict[str, Any]:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body"))


async def reading_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, then answers 200 with its length."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def run(middleware: BodyLimitMiddleware, exchange: Recorder) -> None:
    asyncio.run(middleware(exchange.scope, exchange.receive, exchange.send))


def test_a_declared_length_over_the_limit_is_413_without_reading() -> None:
    exchange = Recorder([b"x" * 100], [(b"content-length", b"101")])
    run(BodyLimitMiddleware(reading_app, max_bytes=100), exchange)
    assert exchange.handed_out == 0
    assert exchange.status() == 413
    start = next(m for m in exchange.sent if m["type"] == "http.response.start")
    assert (b"connection", b"close") in start["headers"]
    error = exchange.body()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "101 bytes" in error["message"] and "100 bytes" in error["message"]
    # A length of thousands of digits is over any limit too (int() would refuse it).
    exchange = Recorder([], [(b"content-length", b"9" * 5000)])
    run(BodyLimitMiddleware(reading_app, max_bytes=100), exchange)
    assert exchange.status() == 413 and exchange.handed_out == 0


def test_a_chunked_body_is_cut_off_at_the_chunk_crossing_the_limit() -> None:
    exchange = Recorder([b"x" * 40] * 10, [(b"transfer-encoding", b"chunked")])
    run(BodyLimitMiddleware(reading_app, max_bytes=100), exchange)
    assert exchange.status() == 413 and exchange.body()["error"]["code"] == "request_too_large"
    assert exchange.handed_out == 3                  # 120 bytes: the third chunk crossed 100


def test_bodies_within_the_limit_pass_whole() -> None:
    for chunks, headers in (([b"x" * 50, b"y" * 50], [(b"transfer-encoding", b"chunked")]),
                            ([b"z" * 100], [(b"content-length", b"100")])):
        exchange = Recorder(chunks, headers)
        run(BodyLimitMiddleware(reading_app, max_bytes=100), exchange)
        assert exchange.status() == 200 and exchange.sent[-1]["body"] == b"100"


def test_a_413_raised_after_the_response_started_is_not_swallowed() -> None:
    async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await receive()

    exchange = Recorder([b"x" * 200], [])
    with pytest.raises(BodyTooLarge):
        run(BodyLimitMiddleware(streaming_app, max_bytes=100), exchange)
