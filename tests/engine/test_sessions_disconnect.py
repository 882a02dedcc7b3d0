"""A streamed session turn whose client is gone before the first token leaves the session idle,
not busy: the real app and engine (tiny model) driven through ASGI, the client's disconnect
delivered exactly as uvicorn delivers it (ASGI 2.3: ``http.disconnect`` already waiting when the
response starts; ASGI 2.4: ``send`` raising ``OSError``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from starlette.requests import ClientDisconnect
from support.serve_faulty import arg_parser, build_test_replica
from support.servers import SERVED_MODEL_NAME

KEY = "disconnect-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [(i * 7) % 200 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def app() -> Iterator:
    # The replica the test server script builds (tiny model, no tiers), here in this process.
    flags = arg_parser().parse_args(["--model", "tiny", "--port", "0", "--max-model-len", "512",
                                     "--num-blocks", "128", "--max-pinned-gb", "none", "--api-key", KEY])
    replica = build_test_replica(flags)
    replica.engine.start()
    yield replica.app
    replica.engine.shutdown()


async def request_and_vanish(app, path: str, body: dict, headers: dict[str, str], spec_version: str) -> None:
    """Send one request whose client is gone by the time the response starts."""
    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in {**AUTH, **headers}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": raw_headers, "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000)}
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if spec_version >= "2.4":
            raise OSError("client disconnected")

    try:
        await app(scope, receive, send)
    except ClientDisconnect:
        pass                      # Starlette's answer to the OSError; the server drops it


async def scenario(app, path: str, body: dict, spec_version: str) -> tuple[dict, int]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH, timeout=60) as c:
        create = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = await c.post("/v1/context", json=create, headers={"x-session-ttl": "300"})
        assert r.status_code == 200, r.text
        sid = r.headers["x-session-id"]
        await request_and_vanish(app, path, {**body, "stream": True}, {"x-session-id": sid}, spec_version)
        await asyncio.sleep(0.2)
        info = (await c.get(f"/v1/context/{sid}")).json()
        # The next turn on the session is served, not refused as busy (409).
        r = await c.post("/v1/completions", json={**create, "prompt": PROMPT + [9]}, headers={"x-session-id": sid})
        await c.delete(f"/v1/context/{sid}")
        return info, r.status_code


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT + [5, 6], "max_tokens": 50}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 50}),
], ids=["completions", "chat"])
def test_stream_gone_before_first_token_leaves_session_idle(app, path, body, spec_version):
    body = {"model": SERVED_MODEL_NAME, "temperature": 0, **body}
    info, status = asyncio.run(scenario(app, path, body, spec_version))
    assert info["busy"] is False
    assert status == 200


async def abort_then_next_turn(app) -> tuple[int, bool]:
    """A streamed session turn whose client goes away after its first event, and the same
    client's next turn sent at once: before the server has processed the disconnect."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH, timeout=60) as c:
        create = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        r = await c.post("/v1/context", json=create, headers={"x-session-ttl": "300"})
        sid = r.headers["x-session-id"]
        body = {**create, "prompt": PROMPT + [5], "max_tokens": 200, "ignore_eos": True, "stream": True}
        raw_headers = [(b"content-type", b"application/json"), (b"x-session-id", sid.encode())]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in AUTH.items()]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": raw_headers, "client": ("127.0.0.1", 5001),
                 "server": ("127.0.0.1", 8000)}
        pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        gone, streaming = asyncio.Event(), asyncio.Event()

        async def receive() -> dict:
            if pending:
                return pending.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                streaming.set()

        aborted = asyncio.create_task(app(scope, receive, send))
        await streaming.wait()
        gone.set()                                       # the client aborts ...
        r = await c.post("/v1/completions", json={**create, "prompt": PROMPT + [5, 6]},
                         headers={"x-session-id": sid})  # ... and sends its next turn at once
        await aborted
        busy = (await c.get(f"/v1/context/{sid}")).json()["busy"]
        await c.delete(f"/v1/context/{sid}")
        return r.status_code, busy


def test_the_next_turn_sent_right_after_an_abort_is_served(app):
    status, busy = asyncio.run(abort_then_next_turn(app))
    assert status == 200 and busy is False
