"""Stored responses survive SIGKILL + restart where sessions do (disk cache dir, Redis): fetched and
continued from the persisted KV after the restart; an expired conversation stays gone; a stored
response asked for with another model answers 400 (from a disk dir; in Redis another model's
replicas do not see it)."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from support.servers import SERVED_MODEL_NAME, ServerProcess, kill_server, start_server, stop_server

from kvhive.sessions.response_store import conversation_of

KEY = "responses-restart-key"
HISTORY = "The quick brown fox jumps over the lazy dog. " * 6      # a few full blocks


def client(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


def create(c: httpx.Client, input: str, previous: dict[str, Any] | None = None,
           model: str = SERVED_MODEL_NAME) -> httpx.Response:
    return c.post("/v1/responses", json={"model": model, "input": input, "max_output_tokens": 4, "temperature": 0,
                                         "previous_response_id": previous["id"] if previous else None})


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()


def test_stored_responses_survive_sigkill_and_restart(persistence) -> None:
    tier, store_args = persistence
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=store_args)
    try:
        with client(server) as c:
            r1 = ok(create(c, HISTORY))
            r2 = ok(create(c, "Again?", r1))
            items = ok(c.get(f"/v1/responses/{r2['id']}/input_items"))
            # A conversation whose session gets a 2 s TTL: its next turn makes that its expiry too.
            short = ok(create(c, "Soon gone"))
            ok(c.patch(f"/v1/context/{conversation_of(short['id'])}", json={"ttl": 2}))
            short = ok(create(c, "Going", short))
            gone_at = time.time() + 2
    finally:
        kill_server(server)
    time.sleep(max(0.0, gone_at + 1 - time.time()))      # the short conversation expires while down
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=store_args)
    try:
        with client(server) as c:
            assert ok(c.get(f"/v1/responses/{r1['id']}")) == r1
            assert ok(c.get(f"/v1/responses/{r2['id']}")) == r2
            assert ok(c.get(f"/v1/responses/{r2['id']}/input_items")) == items
            assert c.get(f"/v1/responses/{short['id']}").status_code == 404
            if tier == "disk":
                responses_dir = os.path.join(store_args[1], "responses")
                deadline = time.monotonic() + 5
                while len(os.listdir(responses_dir)) > 1 and time.monotonic() < deadline:
                    time.sleep(0.1)                 # the sweep drops the expired conversation's records
                assert len(os.listdir(responses_dir)) == 1
            # The conversation goes on from the KV its session kept in the tier.
            r3 = ok(create(c, "Once more?", r2))
            assert r3["usage"]["input_tokens"] > r2["usage"]["total_tokens"]     # the whole history
            # At least r2's prompt in whole blocks before its last token (re-rendering the history
            # may tokenise that token, the assistant header's newline, with the reply).
            assert r3["usage"]["input_tokens_details"]["cached_tokens"] >= (r2["usage"]["input_tokens"] - 1) // 16 * 16
    finally:
        stop_server(server)
    # The same disk dir behind a server of another model: its records are fetched, but not
    # continued. A Redis keeps each model's records in the model's own namespace.
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512,
                          extra_args=(*store_args, "--served-model-name", "other-model"))
    try:
        with client(server) as c:
            if tier == "redis":
                assert c.get(f"/v1/responses/{r3['id']}").status_code == 404
                return
            assert ok(c.get(f"/v1/responses/{r3['id']}"))["model"] == SERVED_MODEL_NAME
            mismatch = create(c, "Hi", r3, model="other-model")
            assert mismatch.status_code == 400
            assert mismatch.json()["error"]["code"] == "response_model_mismatch"
            ok(c.delete(f"/v1/responses/{r1['id']}"))
            assert c.get(f"/v1/responses/{r1['id']}").status_code == 404
            assert ok(c.get(f"/v1/responses/{r2['id']}"))["id"] == r2["id"]
    finally:
        stop_server(server)
