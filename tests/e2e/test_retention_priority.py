"""Retention priorities under memory pressure, over real HTTP; and the scheduling ``priority`` field.

One tiny-model server with a 32-block pool (16 tokens a block), no KV tier, and
``--scheduling-policy priority``. A session's prefix is spilled from the pool by a prompt that
needs nearly all of it, which pins the session's blocks (``PINNED_PRIORITY``). A default-priority
prefix is cached after that spill, then a stream of one-off prompts churns the pool. Plain LRU
would evict the session's blocks first (they were freed before everything else); by priority the
one-off prompts evict the default-priority prefix instead, and the session's prefix still answers
from cache (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from support.servers import SERVED_MODEL_NAME, ServerProcess, metric_samples, start_server, stop_server

BLOCK = 16
NUM_BLOCKS = 32                               # usable; --num-blocks counts the null block too


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("tiny", max_model_len=640,
                       extra_args=("--num-blocks", str(NUM_BLOCKS + 1), "--scheduling-policy", "priority",
                                   "--max-session-ttl", "3600"))
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 5 for i in range(n)]


def body(prompt: list[int], **extra) -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}


def cached_tokens(c: httpx.Client, prompt: list[int], **extra) -> int:
    r = c.post("/v1/completions", json=body(prompt, **extra))
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_pinned_prefix_outlives_one_off_prompts_that_evict_a_default_one(client: httpx.Client) -> None:
    session_prefix = tokens(1, 5 * BLOCK)
    r = client.post("/v1/context", json=body(session_prefix), headers={"x-session-ttl": "3600"})
    assert r.status_code == 200, r.text
    # The session holds its 5 blocks. 28 blocks are more than the 27 it does not hold: its holding
    # is spilled (pinned), and this prompt takes everything else and the session's last block.
    assert cached_tokens(client, tokens(2, (NUM_BLOCKS - 4) * BLOCK)) == 0
    assert sum(metric_samples(client.get("/metrics").text, "kvhive_session_spills_total")) == 1
    default_prefix = tokens(3, 4 * BLOCK)
    assert cached_tokens(client, default_prefix) == 0       # cached now, at the default priority
    for seed in range(10, 14):                              # one-off prompts churn the pool
        cached_tokens(client, tokens(seed, 10 * BLOCK))
    assert cached_tokens(client, session_prefix[:4 * BLOCK] + tokens(20, BLOCK)) == 4 * BLOCK
    assert cached_tokens(client, default_prefix + tokens(21, BLOCK)) == 0


def test_scheduling_priority_is_accepted_within_bounds(client: httpx.Client) -> None:
    prompt = tokens(30, 8)
    for field in (-5, 0, 7):
        assert client.post("/v1/completions", json=body(prompt, priority=field)).status_code == 200
    chat = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "priority": 3}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    r = client.post("/v1/completions", json=body(prompt, priority=2**31))
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = client.post("/v1/completions", json=body(prompt, priority="1"))
    assert r.status_code == 400
