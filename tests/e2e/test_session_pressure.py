"""Idle sessions never hold the device pool against running requests, over real HTTP.

One tiny-model server with a 256-block pool (255 usable, 16 tokens each) and no KV tier. API key A
creates 300 one-block sessions, more than the pool holds, within its default per-key share
(``--max-pinned-gb auto``: half the pool, 2,048 tokens). Key B's 8 concurrent requests, 8 blocks
each, then all run at once (``kvhive_num_requests_running`` reaches 8): the least recently used
sessions release their device blocks. Every session keeps its record and answers its next turn
as an uncached run does; the per-key default answers 429 past half the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.servers import SERVED_MODEL_NAME, ServerProcess, metric_samples, start_server, stop_server

KEY_A, KEY_B = "pressure-key-a", "pressure-key-b"
NUM_SESSIONS = 300
SESSION_PROMPT_TOKENS = 5                  # + 1 output token: one block, 6 tokens of the key's share
LONG_OUTPUT = 120                          # B's requests: 8 + 120 tokens, 8 blocks each
LONG_BLOCKS = 8


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("tiny", api_keys=(KEY_A, KEY_B), max_model_len=512,
                       extra_args=("--num-blocks", "256", "--max-session-ttl", "3600"))
    yield srv
    stop_server(srv)


def client(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=300, headers={"Authorization": f"Bearer {key}"})


def completion(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def session_prompt(i: int) -> list[int]:
    return [(i * 7 + j * 3) % 250 + 3 for j in range(SESSION_PROMPT_TOKENS)]


def metric(c: httpx.Client, name: str, labels: dict[str, str] | None = None) -> float:
    return sum(metric_samples(c.get("/metrics").text, name, labels))


def create_session(c: httpx.Client, i: int) -> str:
    r = c.post("/v1/context", json=completion(session_prompt(i), 1), headers={"x-session-ttl": "3600"})
    assert r.status_code == 200, r.text
    return r.headers["x-session-id"]


def run_concurrently(c: httpx.Client, bodies: list[dict]) -> tuple[list[dict], float]:
    """Send ``bodies`` at once; their answers, and the most requests /metrics saw running meanwhile."""
    done = threading.Event()
    peak = [0.0]

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], metric(c, "kvhive_num_requests_running"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda body: c.post("/v1/completions", json=body), bodies))
    finally:
        done.set()
        watcher.join()
    for r in answers:
        assert r.status_code == 200, r.text
    return [r.json() for r in answers], peak[0]


def test_hundreds_of_idle_sessions_leave_room_for_eight_running_requests(server):
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        with ThreadPoolExecutor(4) as pool:
            session_ids = list(pool.map(lambda i: create_session(a, i), range(NUM_SESSIONS)))
        assert metric(a, "kvhive_sessions_live") == NUM_SESSIONS
        assert metric(a, "kvhive_session_blocks", {"tier": "device"}) >= 250     # the pool is theirs
        spills = metric(a, "kvhive_session_spills_total")
        preemptions = metric(a, "kvhive_num_preemptions_total")

        bodies = [completion([200 + i, 201 + i, 7, 8, 9, 10, 11, 12], LONG_OUTPUT) for i in range(8)]
        answers, peak = run_concurrently(b, bodies)
        assert peak == 8
        assert all(x["usage"]["completion_tokens"] == LONG_OUTPUT for x in answers)
        assert metric(a, "kvhive_session_spills_total") >= spills + 8 * LONG_BLOCKS
        assert metric(a, "kvhive_session_blocks", {"tier": "device"}) <= 255 - 8 * LONG_BLOCKS
        assert metric(a, "kvhive_num_preemptions_total") == preemptions
        assert metric(a, "kvhive_sessions_live") == NUM_SESSIONS                  # records all kept

        # Oldest (spilled) to newest (maybe still pinned): each session's next turn answers what an
        # uncached run (a fresh cache salt) answers.
        for i in range(0, NUM_SESSIONS, 30):                   # each grows by 11 tokens: 1,910 held
            prompt = session_prompt(i) + [40, 41, 42, 43]
            turn = a.post("/v1/completions", json=completion(prompt, 8), headers={"x-session-id": session_ids[i]})
            assert turn.status_code == 200, turn.text
            fresh = a.post("/v1/completions", json=completion(prompt, 8, cache_salt=f"fresh-{i}"))
            assert fresh.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert turn.json()["choices"][0]["text"] == fresh.json()["choices"][0]["text"], i
            info = a.get(f"/v1/context/{session_ids[i]}").json()
            assert info["tokens"] == len(prompt) + 8 and info["busy"] is False


def test_one_key_s_sessions_stop_at_half_the_pool_by_default(server):
    # Key A's sessions hold 1,910 of its 2,048 tokens (300 sessions of 6 tokens, 10 of them grown to 17).
    with client(server, KEY_A) as a, client(server, KEY_B) as b:
        body = completion(list(range(3, 203)), 60)                          # 260 tokens more
        r = a.post("/v1/context", json=body, headers={"x-session-ttl": "60"})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "session_kv_limit" and err["type"] == "rate_limit_error"
        assert "(--max-pinned-gb auto: 50% of the device KV pool, 2.0 MiB)" in err["message"]
        r = b.post("/v1/context", json=body, headers={"x-session-ttl": "60"})
        assert r.status_code == 200, r.text                                  # another key's share
