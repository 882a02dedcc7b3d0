"""``POST /v1/context/{id}/fork`` over real HTTP, and the conversation knobs: a fork reads the
parent's prefix from cache, turns on either side answer as an uncached run of their own
conversation and never change the other, bad forks create nothing, the fork survives a restart
with a disk dir; ``turn_number`` is checked, ``--max-active-conversations`` ends the least recently
used idle conversation, and ``--no-enable-conversation-caching`` refuses ``conversation_id``.

Every stored ``/v1/responses`` branch keeps its own chain pinned, also after the restart.

One server, SIGKILLed and restarted once on the same disk dir (with conversation caching off)."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from support.servers import SERVED_MODEL_NAME, kill_server, start_server, stop_server

KEY, OTHER = "fork-key", "fork-other"
PROMPT = [(i * 11) % 190 + 5 for i in range(40)]
BODY = {"model": SERVED_MODEL_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def client(server, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def complete(c: httpx.Client, prompt: list[int], session_id: str | None = None, **extra) -> dict:
    """A greedy completion of ``prompt`` (in a session, or uncached with a fresh cache_salt)."""
    if session_id is None:
        extra["cache_salt"] = uuid.uuid4().hex
    headers = {} if session_id is None else {"x-session-id": session_id}
    r = c.post("/v1/completions", json={**BODY, "prompt": prompt, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def answer(data: dict) -> tuple[str, int]:
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def token_ids(c: httpx.Client, text: str) -> list[int]:
    r = c.post("/tokenize", json={"model": SERVED_MODEL_NAME, "prompt": text, "add_special_tokens": False})
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fork-disk"))


@pytest.fixture(scope="module")
def server(disk):
    srv = start_server("tiny", api_keys=(KEY, OTHER), max_model_len=512,
                       extra_args=("--disk-cache-dir", disk, "--max-session-ttl", "3600",
                                   "--max-active-conversations", "2"))
    yield srv
    if srv.process.poll() is None:
        stop_server(srv)


@pytest.fixture(scope="module")
def forked(server):
    """A parent of two turns and a fork of it at turn 1: their ids and the conversation so far."""
    with client(server) as c:
        r = c.post("/v1/context", json={**BODY, "prompt": PROMPT}, headers={"x-session-ttl": "900"})
        parent = r.headers["x-session-id"]
        turn1 = PROMPT + token_ids(c, r.json()["choices"][0]["text"])
        second = complete(c, turn1 + [7, 8, 9], parent)
        r = c.post(f"/v1/context/{parent}/fork", json={"turn": 1, "ttl": 1200})
        assert r.status_code == 200, r.text
        child = r.json()
        turn2 = turn1 + [7, 8, 9] + token_ids(c, second["choices"][0]["text"])
    assert child["id"] == r.headers["x-session-id"] != parent and child["forked_from"] == parent
    assert (child["object"], child["ttl"], child["turns"]) == ("context", 1200, 1)
    return parent, child, turn1, turn2


def test_turns_on_a_fork_and_its_parent_answer_as_uncached_runs_and_leave_the_other(server, forked):
    parent, child, turn1, turn2 = forked
    with client(server) as c:
        info = c.get(f"/v1/context/{parent}").json()
        assert (info["turns"], info["tokens"]) == (2, len(turn2))
        assert child["tokens"] == len(turn1) and child["num_blocks"] == len(turn1) // 16
        branch = turn1 + [101, 102, 103]
        text, cached = answer(complete(c, branch, child["id"]))
        assert text == answer(complete(c, branch))[0]
        assert cached == len(turn1) // 16 * 16                    # the parent's blocks, read from cache
        assert c.get(f"/v1/context/{parent}").json() == info       # the child's turn left the parent alone
        more = turn2 + [55, 56]
        text, cached = answer(complete(c, more, parent))
        assert text == answer(complete(c, more))[0] and cached > len(turn1)
        assert c.get(f"/v1/context/{child['id']}").json()["turns"] == 2
        latest = c.post(f"/v1/context/{parent}/fork", headers={"x-session-ttl": "600"}).json()
        assert (latest["turns"], latest["ttl"]) == (3, 600)
    assert server.metric("kvhive_session_forks_total") == 2


def test_bad_forks_are_refused_and_create_nothing(server, forked):
    parent = forked[0]
    with client(server) as c, client(server, OTHER) as other:
        before = len(c.get("/v1/context").json()["data"])
        r = other.post(f"/v1/context/{parent}/fork")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert c.post("/v1/context/sess-nope/fork").status_code == 404
        for body, param in (({"turn": 0}, "turn"), ({"turn": 99}, "turn"), ({"turn": "1"}, "turn"),
                            ({"ttl": 10**9}, "ttl"), ({"ttl": -1}, "ttl"), ({"parent": "x"}, "parent")):
            r = c.post(f"/v1/context/{parent}/fork", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert c.post(f"/v1/context/{parent}/fork", content=b"[1]").status_code == 400
        r = c.patch(f"/v1/context/{parent}", json={"ttl": 900, "colour": "red"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "colour", r.text
        # A TTL header where no session is created would be ignored: refused, naming it.
        for headers in ({"x-session-id": parent, "x-session-ttl": "900"}, {"x-session-ttl": "900"}):
            r = c.post("/v1/completions", json={**BODY, "prompt": PROMPT}, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == "x-session-ttl", r.text
        assert len(c.get("/v1/context").json()["data"]) == before
        assert other.get("/v1/context").json()["data"] == []


def test_turn_number_and_max_active_conversations(server, forked):
    parent, _, _, _ = forked
    with client(server) as c:
        info = c.get(f"/v1/context/{parent}").json()
        r = c.post("/v1/completions", json={**BODY, "prompt": PROMPT + [1], "turn_number": 2},
                   headers={"x-session-id": parent})
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_turn_number"
        assert c.get(f"/v1/context/{parent}").json() == info
        r = c.post("/v1/completions", json={**BODY, "prompt": PROMPT, "turn_number": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "turn_number"
        chat = {**BODY, "messages": [{"role": "user", "content": "hello"}]}
        for name in ("conv-a", "conv-b", "conv-c"):            # --max-active-conversations 2
            r = c.post("/v1/chat/completions", json={**chat, "conversation_id": name, "turn_number": 1})
            assert r.status_code == 200, r.text
        live = {s["id"] for s in c.get("/v1/context").json()["data"]}
        assert {"conv-b", "conv-c"} <= live and "conv-a" not in live and parent in live
    assert server.metric("kvhive_session_conversation_evictions_total") == 1


def respond(c: httpx.Client, text: str, previous: str | None = None) -> dict:
    r = c.post("/v1/responses", json={"model": SERVED_MODEL_NAME, "input": text, "max_output_tokens": 4,
                                       "temperature": 0, "previous_response_id": previous})
    assert r.status_code == 200, r.text
    return r.json()


def disk_pinned(server, at_least: float) -> float:
    """The blocks live pins hold in the disk tier, once at least ``at_least`` (saves are async)."""
    deadline = time.monotonic() + 10
    while (value := server.metric("kvhive_session_blocks", {"tier": "disk"})) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return value


def test_every_responses_branch_keeps_its_own_pinned_chain(server):
    words = " ".join(f"w{i}" for i in range(60))
    with client(server) as c:
        parent = respond(c, f"Start here: {words}")
        pinned = disk_pinned(server, 1)
        a = respond(c, f"Branch one: {words[::-1]}", parent["id"])
        a_pinned = disk_pinned(server, pinned + 1)
        b = respond(c, f"Branch two: {words.upper()}", parent["id"])
        # The session moved on to branch two; branch one's own blocks stay pinned beside it.
        both = disk_pinned(server, a_pinned + 1)
        assert both > a_pinned > pinned
        a2, b2 = respond(c, "And then?", a["id"]), respond(c, "And then?", b["id"])
        for previous, turn in ((a, a2), (b, b2)):
            assert turn["usage"]["input_tokens_details"]["cached_tokens"] >= \
                (previous["usage"]["input_tokens"] - 1) // 16 * 16
        # Deleting a response drops its chain's pin (the blocks no other chain or session pins).
        before = disk_pinned(server, 0)
        assert c.delete(f"/v1/responses/{a2['id']}").status_code == 200
        assert server.metric("kvhive_session_blocks", {"tier": "disk"}) < before


def test_a_branch_sent_while_another_runs_pins_its_own_chain(server):
    """A branch whose conversation is busy with another turn runs beside the session and still
    pins its own chain, from the blocks the engine reports for it."""
    words = " ".join(f"v{i}" for i in range(24))
    with client(server) as c, client(server) as side:
        parent = respond(c, f"Another start: {words}")
        before = disk_pinned(server, 1)
        body = {"model": SERVED_MODEL_NAME, "input": f"Long branch: {words[::-1]}", "max_output_tokens": 160,
                "temperature": 0, "previous_response_id": parent["id"], "stream": True}
        with c.stream("POST", "/v1/responses", json=body) as running:
            assert running.status_code == 200, running.read()
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))     # the long branch is running
            beside = respond(side, f"Short branch: {words.upper()}", parent["id"])
            for _ in lines:
                pass
        # The session holds the long branch now; the short branch's own blocks were pinned beside
        # it, so deleting the short branch drops pins nothing else holds.
        pinned = disk_pinned(server, before + 1)
        assert c.delete(f"/v1/responses/{beside['id']}").status_code == 200
        assert server.metric("kvhive_session_blocks", {"tier": "disk"}) < pinned


def test_a_fork_survives_a_restart_and_conversation_caching_can_be_off(server, forked, disk):
    parent, child, turn1, _ = forked
    with client(server) as c:
        before = c.get(f"/v1/context/{child['id']}").json()
    pinned = disk_pinned(server, 0)             # sessions' and stored responses' chains' pins
    kill_server(server)
    again = start_server("tiny", api_keys=(KEY, OTHER), max_model_len=512,
                         extra_args=("--disk-cache-dir", disk, "--max-session-ttl", "3600",
                                     "--no-enable-conversation-caching"))
    try:
        with client(again) as c:
            after = c.get(f"/v1/context/{child['id']}").json()
            assert {k: after[k] for k in ("tokens", "turns", "ttl", "expires_at")} == \
                {k: before[k] for k in ("tokens", "turns", "ttl", "expires_at")}
            assert after["blocks"]["disk"] == before["num_blocks"] > 0
            assert disk_pinned(again, pinned) == pinned           # every branch's chain pinned again
            r = c.post(f"/v1/context/{child['id']}/fork", json={"turn": 1})
            assert r.status_code == 200 and r.json()["tokens"] == len(turn1)
            chat = {**BODY, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "conv-x"}
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "conversation_id"
            assert "--no-enable-conversation-caching" in r.json()["error"]["message"]
    finally:
        stop_server(again)
