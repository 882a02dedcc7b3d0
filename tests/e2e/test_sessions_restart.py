"""Sessions and their expiries survive SIGKILL + restart with a disk cache dir or with Redis, and a
10-turn conversation on the default model gives the same greedy tokens with sessions, plain
prefix caching and no caching."""

from __future__ import annotations

import time

import httpx
import pytest
from support.servers import SERVED_MODEL_NAME, kill_server, start_server, stop_server

from kvhive.config import CacheConfig, EngineConfig, SchedulerConfig
from kvhive.core.model_files import default_model_path
from kvhive.engine.core import LLMEngine
from kvhive.request import SamplingParams

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


@pytest.fixture(scope="module")
def default_engines():
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.model.loader import load_model

    path = default_model_path()
    loaded, tok = load_model(path, dtype="float32", device="cpu"), Tokenizer.from_model_path(path)

    def make(prefix: bool) -> LLMEngine:
        cfg = EngineConfig(model_path=path, cache=CacheConfig(num_blocks=256, enable_prefix_caching=prefix),
                           scheduler=SchedulerConfig(max_model_len=2048))
        return LLMEngine(cfg, loaded=loaded, tokenizer=tok)

    return tok, make


def chat(engine, tok, session_id):
    """10 turns; returns the reply tokens and cached tokens of each."""
    messages, replies, cached = [], [], []
    greedy = SamplingParams(max_tokens=12, temperature=0)
    for t in range(10):
        messages.append({"role": "user", "content": f"Turn {t}: tell me one fact about the number {t * 7}."})
        engine.add_request(f"r{t}", tok.encode_chat(messages), greedy, session_id=session_id)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
                if out.finished:
                    cached.append(out.num_cached_tokens)
        replies.append(tokens)
        text = tok.decode([x for x in tokens if x not in tok.eos_token_ids])
        messages.append({"role": "assistant", "content": text})
    return replies, cached


def test_ten_turns_same_greedy_tokens(default_engines):
    tok, make = default_engines
    plain, _ = chat(make(prefix=False), tok, None)
    prefix, prefix_cached = chat(make(prefix=True), tok, None)
    held, held_cached = chat(make(prefix=True), tok, "conv")
    assert held == prefix == plain
    # The session path reuses at least what prefix caching does, every turn.
    assert all(h >= p for h, p in zip(held_cached, prefix_cached, strict=True))
    assert sum(held_cached) > sum(prefix_cached)
