"""``kvhive serve --speculative-config '{"method": "history", ...}' --api-key A --api-key B`` over
real HTTP, on the default model: a prompt that continues an earlier answer drafts from the
server's history (the /metrics history counters grow) only when the same API key sent that
answer; the other key's request gets no history draft and the same greedy text."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest
from support.cluster import ReplicaProcess, running_replicas

HISTORY = ('{"method": "history", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 5, '
           '"history_max_tokens": 20000, "history_tenant_max_tokens": 10000}')
KEYS = {"a": "history-key-a", "b": "history-key-b"}
PROMPTS = {"a": "The lighthouse on the northern cape was built in 1872. Its first keeper",
           "b": "To bake bread at home, first mix flour, water, salt and yeast. Then"}


@pytest.fixture(scope="module")
def replica() -> Iterator[ReplicaProcess]:
    """One replica drafting from its history, with two API keys."""
    server = ReplicaProcess(extra_args=("--speculative-config", HISTORY, "--api-key", KEYS["a"],
                                        "--api-key", KEYS["b"]))
    with running_replicas([server]):
        yield server


def _complete(replica: ReplicaProcess, key: str, prompt: str) -> str:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    response = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _history_counts(replica: ReplicaProcess) -> tuple[float, float]:
    text = httpx.get(f"{replica.url}/metrics", timeout=30).text
    counts = []
    for name in ("kvhive_spec_decode_num_history_draft_tokens_total",
                 "kvhive_spec_decode_num_history_accepted_tokens_total"):
        match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        counts.append(float(match.group(1)))
    return counts[0], counts[1]


def test_history_drafts_serve_only_the_key_that_wrote_the_text(replica: ReplicaProcess) -> None:
    answers = {owner: _complete(replica, KEYS[owner], prompt) for owner, prompt in PROMPTS.items()}
    for owner, other in (("a", "b"), ("b", "a")):
        words = answers[owner].split(" ")
        continued = PROMPTS[owner] + " ".join(words[:len(words) // 3])
        before = _history_counts(replica)
        by_other = _complete(replica, KEYS[other], continued)
        assert _history_counts(replica) == before, f"key {other} drafted from key {owner}'s text"
        assert _complete(replica, KEYS[owner], continued) == by_other
        drafted, accepted = _history_counts(replica)
        assert drafted > before[0] and accepted > before[1], f"key {owner} drafted nothing from its history"
