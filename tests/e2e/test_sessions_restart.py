"""Sessions and their expiries survive SIGKILL + restart of the server, with a disk cache dir or with
Redis."""

from __future__ import annotations

import time

import httpx
from support.servers import SERVED_MODEL_NAME, kill_server, start_server, stop_server

KEY = "restart-key"
PROMPT = [(i * 13) % 200 + 3 for i in range(70)]


def test_sessions_and_expiries_survive_sigkill_and_restart(persistence):
    tier, store_args = persistence
    args = (*store_args, "--max-session-ttl", "3600")
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=args)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": SERVED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
            r = c.post("/v1/context", json=body, headers={"x-session-ttl": "900"})
            sid = r.headers["x-session-id"]
            short = c.post("/v1/context", json={**body, "prompt": PROMPT[::-1]},
                           headers={"x-session-ttl": "2"}).headers["x-session-id"]
            before = c.get(f"/v1/context/{sid}").json()
            num_blocks = len(PROMPT + [0] * 4) // 16
            assert before["blocks"][tier] == num_blocks
            short_expires = c.get(f"/v1/context/{short}").json()["expires_at"]
        assert server.metric("kvhive_sessions_live") == 2
    finally:
        kill_server(server)
    time.sleep(max(0.0, short_expires + 1 - time.time()))   # the short session expires while down
    server = start_server("tiny", api_keys=(KEY,), max_model_len=512, extra_args=args)
    try:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
            after = c.get(f"/v1/context/{sid}").json()
            assert (after["tokens"], after["expires_at"], after["ttl"]) == \
                (before["tokens"], before["expires_at"], before["ttl"])
            assert after["blocks"][tier] == before["blocks"][tier]
            assert c.get(f"/v1/context/{short}").status_code == 404
            # The restarted server pinned the live session's blocks again (and only those).
            assert server.metric("kvhive_session_blocks", {"tier": tier}) == num_blocks
            if tier == "disk":
                deadline = time.monotonic() + 5
                while server.metric("kvhive_session_expiries_total") < 1 and time.monotonic() < deadline:
                    time.sleep(0.2)                 # the sweep drops the expired one within a second
                assert server.metric("kvhive_session_expiries_total") == 1
            else:
                # One key per session, expiring with it: Redis dropped the short one itself, and a
                # replica loads a session on first use (the GET above), never every session.
                import redis

                admin = redis.Redis.from_url(store_args[1])
                keys = admin.keys(f"kvhive:{SERVED_MODEL_NAME}:sessions:*")
                assert [k.decode().rsplit(":", 1)[1] for k in keys] == [sid]
                # Every key the replica wrote is in its model's namespace, the data marker aside.
                others = set(admin.keys("*")) - set(admin.keys(f"kvhive:{SERVED_MODEL_NAME}:*"))
                assert others == {b"kvhive:data-marker"}
                assert admin.keys(f"kvhive:{SERVED_MODEL_NAME}:kv:*")
                assert server.metric("kvhive_session_expiries_total") == 0
            assert server.metric("kvhive_sessions_live") == 1
            r = c.post("/v1/completions", json={**body, "prompt": PROMPT + [1, 2]},
                       headers={"x-session-id": sid})
            assert r.status_code == 200
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64   # loaded from the tier
            assert server.metric("kvhive_session_hit_tokens_total") == 64
            assert c.delete(f"/v1/context/{sid}").status_code == 200
            assert server.metric("kvhive_session_blocks", {"tier": tier}) == 0
    finally:
        stop_server(server)
