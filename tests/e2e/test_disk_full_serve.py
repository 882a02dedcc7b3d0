"""A server whose ``--disk-cache-dir`` fills up (a small tmpfs and a filler file): a new session, a
turn and a stored response whose records cannot be written answer 507 in OpenAI's error shape, the
server keeps serving, and once there is room again sessions work; after SIGKILL and after a clean
stop no session or stored response that answered 200 is lost, and old records are intact."""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
from support.api import assert_error
from support.servers import (
    SERVED_MODEL_NAME,
    ServerProcess,
    kill_server,
    read_sse,
    start_server,
    stop_server,
)
from support.tmpfs import SmallTmpfs, small_tmpfs

from kvhive.sessions.response_store import conversation_of

PROMPT = [(i * 13) % 200 + 3 for i in range(70)]
BODY = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
FS_BYTES = 8 << 20


def serve(fs: SmallTmpfs) -> ServerProcess:
    return start_server("tiny", max_model_len=512, command_prefix=fs.command_prefix,
                        extra_args=("--disk-cache-dir", fs.inner_path, "--max-session-ttl", "3600"))


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()


def new_session(c: httpx.Client, prompt: list[int]) -> httpx.Response:
    return c.post("/v1/context", json={**BODY, "prompt": prompt}, headers={"x-session-ttl": "900"})


def store_response(c: httpx.Client, text: str) -> httpx.Response:
    return c.post("/v1/responses", json={"model": SERVED_MODEL_NAME, "input": text, "max_output_tokens": 2,
                                         "temperature": 0})


def assert_not_durable(r: httpx.Response) -> None:
    assert_error(r, 507, code="insufficient_storage", error_type="server_error",
                 contains=("could not be written to disk", "No space left"))


def settle_disk_writes(server: ServerProcess) -> None:
    """Wait until the disk tier's bytes written stop growing (its writer has caught up)."""
    last = -1.0
    for _ in range(100):
        now = server.metric("kvhive_kv_tier_bytes_in_total", {"tier": "disk"})
        if now == last and now > 0:
            return
        last = now
        time.sleep(0.3)


def temp_files(root: str) -> list[str]:
    return [n for _, _, names in os.walk(root) for n in names if n.endswith(".tmp")]


def test_full_disk_refuses_records_with_507_and_loses_no_session(tmp_path) -> None:
    with small_tmpfs(str(tmp_path / "fs"), FS_BYTES) as fs:
        server = serve(fs)
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as c:
                old = new_session(c, PROMPT)
                old_id = old.headers["x-session-id"]
                ok(old)
                kept_response = ok(store_response(c, "Kept before the disk filled."))
                before = ok(c.get(f"/v1/context/{old_id}"))
                settle_disk_writes(server)
                filler = fs.fill()

                # New records cannot be written: 507 before anything runs, nothing is created.
                assert_not_durable(new_session(c, PROMPT[::-1]))
                streamed = c.post("/v1/context", json={**BODY, "stream": True}, headers={"x-session-ttl": "60"})
                assert_not_durable(streamed)
                chat = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2, "conversation_id": "conv-on-a-full-disk"}
                assert_not_durable(c.post("/v1/chat/completions", json=chat))
                assert_not_durable(store_response(c, "Not stored."))
                # A turn of the old session (its blocks are on disk already): its record cannot be
                # rewritten, so the turn answers 507; the session stays, its old record intact.
                assert_not_durable(c.post("/v1/completions", json=BODY, headers={"x-session-id": old_id}))
                with c.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                              headers={"x-session-id": old_id}) as streamed_turn:
                    assert streamed_turn.status_code == 200      # the headers went out before the turn ended
                    events = read_sse(streamed_turn)
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "insufficient_storage", events
                assert ok(c.get(f"/v1/context/{old_id}"))["tokens"] == before["tokens"]
                live = {s["id"] for s in ok(c.get("/v1/context"))["data"]}
                assert live == {old_id, conversation_of(kept_response["id"])}
                assert c.get("/v1/context/conv-on-a-full-disk").status_code == 404

                # Everything else is served on (new blocks the disk tier cannot take are misses there).
                ok(c.post("/v1/completions", json={**BODY, "prompt": [p + 1 for p in PROMPT]}))
                assert ok(c.get(f"/v1/responses/{kept_response['id']}")) == kept_response
                assert c.get("/health").status_code == 200
                assert "kvhive_kv_tier_write_errors_total{" in c.get("/metrics").text
                # Two creates, a conversation, a response's conversation and two turns were refused.
                assert server.metric("kvhive_session_record_write_errors_total") == 6

                os.unlink(filler)                  # room again
                fresh = new_session(c, PROMPT[:40])
                fresh_id = fresh.headers["x-session-id"]
                ok(fresh)
                ok(c.post("/v1/completions", json=BODY, headers={"x-session-id": old_id}))
                fresh_response = ok(store_response(c, "Stored once there is room."))
                sessions = {s["id"]: s for s in ok(c.get("/v1/context"))["data"]}
            log = server.log_tail(20_000)
        finally:
            kill_server(server)
        assert "could not persist" not in log
        assert log.count("session records: writes failed") <= 2, log      # one line per interval
        assert temp_files(fs.path) == []

        for restart in (kill_server, stop_server):  # after SIGKILL, then after a clean stop
            server = serve(fs)
            try:
                with httpx.Client(base_url=server.base_url, timeout=60) as c:
                    after = {s["id"]: s for s in ok(c.get("/v1/context"))["data"]}
                    assert set(after) == set(sessions) == {old_id, fresh_id, conversation_of(kept_response["id"]),
                                                           conversation_of(fresh_response["id"])}
                    for sid in sessions:
                        assert (after[sid]["tokens"], after[sid]["expires_at"]) == \
                            (sessions[sid]["tokens"], sessions[sid]["expires_at"])
                    assert ok(c.get(f"/v1/responses/{kept_response['id']}")) == kept_response
                    assert ok(c.get(f"/v1/responses/{fresh_response['id']}")) == fresh_response
                    assert c.get("/v1/context/conv-on-a-full-disk").status_code == 404
            finally:
                restart(server)
            assert temp_files(fs.path) == []
