"""Requests to a server's OpenAI API that must succeed, hostile bodies, and the check of OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import httpx
from support.servers import SERVED_MODEL_NAME, read_sse

MODEL = SERVED_MODEL_NAME
DEEP = b"[" * 100_000                   # a body nested deeper than any JSON limit
# Lone surrogates as JSON escapes: json.dumps writes them so (ensure_ascii), as a client's bytes.
LONE = "a\ud800b"
LONG_PROMPT = " ".join(f"Fact {i}: the {i}th colour of the list is number {i * 7}." for i in range(12))


def complete(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    """A non-streamed completion that must succeed."""
    r = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def chat(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    """A non-streamed chat completion that must succeed."""
    r = client.post("/v1/chat/completions", json={"model": MODEL, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, path: str, **fields: Any) -> list[dict[str, Any] | str]:
    """All SSE events of a streamed request that must succeed."""
    with client.stream("POST", path, json={"model": MODEL, "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(r)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", contains: tuple[str, ...] = ()) -> None:
    """The response is OpenAI's error shape with the expected status, type, param and code."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == error_type
    assert error["param"] == param
    assert error["code"] == code
    for text in contains:
        assert text in error["message"], error["message"]


def chat_body(content: Any, **extra: Any) -> dict[str, Any]:
    """A chat completion body of one user message, two tokens long."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
