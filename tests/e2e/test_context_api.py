"""``/v1/context`` and sessions through real HTTP on the tiny model: create, use, manage, TTLs,
ownership, limits and bad input (one server with two API keys and small limits)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from support.servers import SERVED_MODEL_NAME, SLOW_MARKER, ServerProcess, start_server, stop_server

from kvhive.core.model_files import default_model_path
from kvhive.core.tokenizer import Tokenizer

KEY_A, KEY_B = "key-a", "key-b"
PROMPT = [(i * 7) % 200 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512, faulty=True,
                       extra_args=("--max-session-ttl", "3600", "--default-session-ttl", "120",
                                   "--max-sessions-per-key", "4"))
    yield srv
    stop_server(srv)


def client(server: ServerProcess, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def completion(prompt, max_tokens=8, **extra):
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def create(c: httpx.Client, body=None, ttl="300") -> tuple[str, dict]:
    r = c.post("/v1/context", json=body or completion(PROMPT), headers={"x-session-ttl": ttl})
    assert r.status_code == 200, r.text
    return r.headers["x-session-id"], r.json()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_create_use_extend(server):
    with client(server) as c:
        sid, first = create(c)
        assert first["usage"]["completion_tokens"] == 8
        info = c.get(f"/v1/context/{sid}").json()
        assert info["tokens"] == len(PROMPT) + 8 and info["model"] == SERVED_MODEL_NAME
        assert info["blocks"]["device"] >= len(PROMPT) // 16
        assert info["expires_at"] - info["created"] in range(299, 302)
        tokens = info["tokens"]
        # Rebuild the exact session tokens from the engine's view: prompt + 8 greedy tokens.
        r = c.post("/v1/completions", json=completion(PROMPT + [5, 6, 7]), headers={"x-session-id": sid})
        assert r.status_code == 200 and r.headers["x-session-id"] == sid
        # Diverged after the prompt (the outputs were not resent): the common part by prefix match,
        # its whole blocks by hash and the rest copied from the session's partly filled block (and
        # any of 5, 6 the session's reply started with, too).
        assert len(PROMPT) <= r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] <= len(PROMPT) + 2
        assert c.get(f"/v1/context/{sid}").json()["tokens"] == len(PROMPT) + 3 + 8 != tokens


def test_chat_conversation_id_and_end(server):
    with client(server) as c:
        msgs = [{"role": "user", "content": "hello there, how are you today?"}]
        body = {"model": SERVED_MODEL_NAME, "messages": msgs, "max_tokens": 6, "temperature": 0,
                "conversation_id": "conv-1"}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["x-session-id"] == "conv-1"
        info = c.get("/v1/context/conv-1").json()
        assert info["ttl"] == 120                       # --default-session-ttl
        msgs2 = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "and then?"}]
        r2 = c.post("/v1/chat/completions", json={**body, "messages": msgs2, "end_conversation": True})
        assert r2.status_code == 200
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        error(c.get("/v1/context/conv-1"), 404)


def test_manage_list_patch_delete(server):
    with client(server) as c:
        sid, _ = create(c)
        assert sid in [s["id"] for s in c.get("/v1/context").json()["data"]]
        r = c.patch(f"/v1/context/{sid}", json={"ttl": 1000})
        assert r.status_code == 200 and r.json()["ttl"] == 1000
        assert r.json()["expires_at"] >= time.time() + 990
        r = c.patch(f"/v1/context/{sid}", headers={"x-session-ttl": "50"})
        assert r.json()["ttl"] == 50
        error(c.patch(f"/v1/context/{sid}", json={"ttl": -3}), 400)
        # A body's seconds are a JSON number ("60" is not), and a PATCH without any TTL says so.
        for body, code in (({"ttl": "60"}, "invalid_session_ttl"), ({}, "missing_session_ttl")):
            refused = error(c.patch(f"/v1/context/{sid}", json=body), 400)
            assert (refused["param"], refused["code"]) == ("ttl", code)
        assert error(c.post(f"/v1/context/{sid}/fork", json={"ttl": "60"}), 400)["param"] == "ttl"
        assert c.get(f"/v1/context/{sid}").json()["ttl"] == 50          # nothing lost
        assert c.delete(f"/v1/context/{sid}").json()["deleted"] is True
        error(c.get(f"/v1/context/{sid}"), 404)
        error(c.delete(f"/v1/context/{sid}"), 404)
        err = error(c.post("/v1/completions", json=completion(PROMPT), headers={"x-session-id": sid}), 404)
        assert err["code"] == "session_not_found"


def test_sliding_expiry(server):
    with client(server) as c:
        sid, _ = create(c, ttl="2")
        time.sleep(1.2)
        assert c.post("/v1/completions", json=completion(PROMPT),
                      headers={"x-session-id": sid}).status_code == 200      # slides to now + 2
        time.sleep(1.2)
        assert c.get(f"/v1/context/{sid}").status_code == 200
        time.sleep(2.5)
        error(c.get(f"/v1/context/{sid}"), 404)
        error(c.post("/v1/completions", json=completion(PROMPT), headers={"x-session-id": sid}), 404)


def test_missing_ttl_takes_the_default(server):
    with client(server) as c:
        r = c.post("/v1/context", json=completion(PROMPT))
        sid = r.headers["x-session-id"]
        assert c.get(f"/v1/context/{sid}").json()["ttl"] == 120         # --default-session-ttl
        c.delete(f"/v1/context/{sid}")


@pytest.mark.parametrize("ttl,code", [("", "missing_session_ttl"), ("-5", "invalid_session_ttl"),
                                      ("0", "invalid_session_ttl"), ("1.5", "invalid_session_ttl"),
                                      ("abc", "invalid_session_ttl"), ("3601", "session_ttl_too_long")])
def test_bad_ttl(server, ttl, code):
    with client(server) as c:
        before = len(c.get("/v1/context").json()["data"])
        headers = {"x-session-ttl": ttl}
        err = error(c.post("/v1/context", json=completion(PROMPT), headers=headers), 400)
        assert err["code"] == code and err["param"] == "x-session-ttl"
        assert len(c.get("/v1/context").json()["data"]) == before


def test_other_key_gets_404_and_no_shared_prefix(server):
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        prompt = [(i * 11) % 200 + 5 for i in range(64)]
        sid, _ = create(a, completion(prompt))
        assert sid not in [s["id"] for s in b.get("/v1/context").json()["data"]]
        for r in (b.get(f"/v1/context/{sid}"), b.patch(f"/v1/context/{sid}", json={"ttl": 5}),
                  b.delete(f"/v1/context/{sid}"),
                  b.post("/v1/completions", json=completion(prompt), headers={"x-session-id": sid})):
            error(r, 404)
        assert a.get(f"/v1/context/{sid}").status_code == 200          # untouched
        # The same prompt from key B gets no prefix hit from key A's blocks (separate cache salt).
        r = b.post("/v1/completions", json=completion(prompt))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Key A's own blocks serve every token but the last: three blocks by hash, and 15 tokens
        # copied from the fourth (the last token is always computed).
        r = a.post("/v1/completions", json=completion(prompt))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 63
        a.delete(f"/v1/context/{sid}")


def test_session_count_limit_429(server):
    with client(server, KEY_B) as c:
        for s in c.get("/v1/context").json()["data"]:
            c.delete(f"/v1/context/{s['id']}")
        ids = [create(c)[0] for _ in range(4)]
        err = error(c.post("/v1/context", json=completion(PROMPT), headers={"x-session-ttl": "60"}), 429)
        assert "--max-sessions-per-key" in err["message"]
        assert len(c.get("/v1/context").json()["data"]) == 4
        for sid in ids:
            c.delete(f"/v1/context/{sid}")


def test_wrong_model_and_concurrent_409(server):
    with client(server) as c:
        sid, _ = create(c)
        err = error(c.post("/v1/completions", json={**completion(PROMPT), "model": "other"},
                           headers={"x-session-id": sid}), 404)
        assert err["code"] == "model_not_found"
        # Two requests at once on one session: the second is refused with 409, the first completes.
        # The first is streamed, so the second is sent while it is known to be running; its outputs
        # come slowly (SLOW_MARKER), so it outlasts the 0.15 s a busy request waits for a turn to end.
        slow = Tokenizer.from_model_path(default_model_path()).encode(SLOW_MARKER)
        long_turn = {**completion(PROMPT + slow, max_tokens=300), "stream": True}
        with client(server) as c2, c2.stream("POST", "/v1/completions", json=long_turn,
                                             headers={"x-session-id": sid}) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            err = error(c.post("/v1/completions", json=completion(PROMPT), headers={"x-session-id": sid}), 409)
            assert err["code"] == "session_busy"
            assert any(line == "data: [DONE]" for line in lines)
        assert c.get(f"/v1/context/{sid}").json()["tokens"] == len(PROMPT) + len(slow) + 300


def test_the_next_turn_right_after_aborting_a_stream_is_accepted(server):
    # A client that aborts its stream and sends the next turn at once may reach the server before
    # the server has processed the disconnect: the session is free once it has, not 409 busy.
    with client(server) as c:
        sid, _ = create(c)
        for i in range(5):
            long_turn = {**completion(PROMPT + [i + 1], max_tokens=200), "stream": True}
            with client(server) as c2, c2.stream("POST", "/v1/completions", json=long_turn,
                                                 headers={"x-session-id": sid}) as running:
                assert running.status_code == 200
                assert next(line for line in running.iter_lines() if line.startswith("data: "))
            # Leaving the block closed the connection mid-stream: the client's own abort.
            r = c.post("/v1/completions", json=completion(PROMPT + [i + 1, 5]), headers={"x-session-id": sid})
            assert r.status_code == 200, r.text
        c.delete(f"/v1/context/{sid}")


def test_create_with_chat_body_and_stream(server):
    with client(server) as c:
        body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0, "stream": True}
        with c.stream("POST", "/v1/context", json=body, headers={"x-session-ttl": "60"}) as r:
            assert r.status_code == 200
            sid = r.headers["x-session-id"]
            r.read()
        assert c.get(f"/v1/context/{sid}").json()["tokens"] > 4
        c.delete(f"/v1/context/{sid}")


def test_session_metrics(server):
    def metric(name, labels=None):
        return server.metric(name, labels)

    turns, hits, deletes = (metric("kvhive_session_turns_total"), metric("kvhive_session_hit_tokens_total"),
                            metric("kvhive_session_deletes_total"))
    with client(server) as c:
        sid, first = create(c)                # its prompt may hit blocks earlier tests left cached
        r = c.post("/v1/completions", json=completion(PROMPT + [5, 6, 7]), headers={"x-session-id": sid})
        cached = [x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in (first, r.json())]
        # Diverged from the session: the prompt in common, its 2 whole blocks by hash and the rest
        # copied from the session's partly filled block (and any of 5, 6 its reply started with).
        assert len(PROMPT) <= cached[1] <= len(PROMPT) + 2
        assert metric("kvhive_session_turns_total") == turns + 2
        assert metric("kvhive_session_hit_tokens_total") == hits + sum(cached)
        assert metric("kvhive_sessions_live") >= 1
        assert metric("kvhive_session_tokens") >= len(PROMPT) + 3 + 8
        # Idle, the session holds its blocks in the device pool (no store tiers on this server).
        assert metric("kvhive_session_blocks", {"tier": "device"}) >= (len(PROMPT) + 3 + 8) // 16
        c.delete(f"/v1/context/{sid}")
        assert metric("kvhive_session_deletes_total") == deletes + 1


def test_max_pinned_gb_answers_429():
    # The tiny model keeps 512 bytes of KV per token: 0.00005 GiB is 104 tokens per API key.
    srv = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512,
                       extra_args=("--max-pinned-gb", "0.00005"))
    try:
        with client(srv) as a, client(srv, KEY_B) as b:
            sid, _ = create(a)                                         # 40 + 8 tokens
            second, _ = create(a)                                      # 96 tokens held
            err = error(a.post("/v1/context", json=completion(PROMPT), headers={"x-session-ttl": "60"}), 429)
            assert err["code"] == "session_kv_limit" and err["type"] == "rate_limit_error"
            assert err["message"].startswith("This API key's sessions would hold 144 tokens (72.0 KiB) of KV, "
                                             "over its limit of 52.4 KiB (--max-pinned-gb 5e-05): 96 tokens held")
            assert len(a.get("/v1/context").json()["data"]) == 2          # nothing was created
            # Extending a session past the limit is refused too, and the session is left as it was.
            err = error(a.post("/v1/completions", json=completion(PROMPT + [1] * 20),
                               headers={"x-session-id": sid}), 429)
            assert "would hold 116 tokens" in err["message"] and "--max-pinned-gb" in err["message"]
            info = a.get(f"/v1/context/{sid}").json()
            assert info["tokens"] == len(PROMPT) + 8 and info["busy"] is False
            # The limit is per key, and deleting a session gives its share back.
            create(b)
            a.delete(f"/v1/context/{second}")
            create(a)
    finally:
        stop_server(srv)


def test_sessions_over_the_keeper_tier_answer_429():
    # A CPU tier of 12 tiny-model blocks (8 KiB each) keeps the pins: sessions may pin 10.8 of them
    # (no per-key share: one key may take them all).
    srv = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512,
                       extra_args=("--cpu-offload-gb", str(12 * 8192 / 2**30), "--max-pinned-gb", "none"))
    prompts = [[(i * 11 + k * 5) % 200 + 3 for i in range(41)] for k in range(5)]
    try:
        with client(srv) as a, client(srv, KEY_B) as b:
            first, _ = create(a, completion(prompts[0]))                 # 41 + 8 tokens: 3 full blocks
            create(a, completion(prompts[1]))
            create(b, completion(prompts[2]))                            # 9 blocks pinned, by two keys
            assert a.get(f"/v1/context/{first}").json()["blocks"]["cpu"] == 3
            err = error(b.post("/v1/context", json=completion(prompts[3]), headers={"x-session-ttl": "60"}), 429)
            assert err["code"] == "session_tier_full" and err["type"] == "rate_limit_error"
            assert err["message"].startswith("The server's sessions would pin 96.0 KiB of KV in its cpu tier, "
                                             "over the 86.4 KiB it keeps for sessions (90% of --cpu-offload-gb")
            # Nothing stored is lost, requests without a session still run, and a session may grow
            # into the room its own blocks leave.
            assert len(a.get("/v1/context").json()["data"]) == 2 and len(b.get("/v1/context").json()["data"]) == 1
            assert b.post("/v1/completions", json=completion(prompts[3])).status_code == 200
            r = a.post("/v1/completions", json=completion(prompts[0] + [5, 6, 7, 8]), headers={"x-session-id": first})
            assert r.status_code == 200, r.text
            err = error(a.post("/v1/completions", json=completion(prompts[0] + [5] * 40),
                               headers={"x-session-id": first}), 429)
            assert err["code"] == "session_tier_full"
            info = a.get(f"/v1/context/{first}").json()
            assert info["tokens"] == 41 + 4 + 8 and info["busy"] is False and info["blocks"]["cpu"] == 3
            # Deleting a session gives its blocks back.
            a.delete(f"/v1/context/{first}")
            create(b, completion(prompts[3]))
    finally:
        stop_server(srv)
