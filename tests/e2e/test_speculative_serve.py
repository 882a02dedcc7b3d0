"""``kvhive serve --speculative-config`` over real HTTP with the ``openai`` SDK, on the default model:
a prompt that asks for a paragraph quoted back is answered with the same greedy text, streamed and
not, as a replica without speculation gives it, while the speculating replica's /metrics count
drafts it accepted (several tokens per step); an open question is answered the same too."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from support.cluster import ReplicaProcess, running_replicas

SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
PARAGRAPH = ("The pump must be primed before it is started. Open the bleed valve on the top of the housing, "
             "fill the housing with clean water until it runs from the valve, then close the valve.")
QUOTING = f"Repeat this paragraph word for word:\n\n{PARAGRAPH}"
OPEN = "Name three things people keep in a kitchen."


@pytest.fixture(scope="module")
def replicas() -> Iterator[dict[str, ReplicaProcess]]:
    """One replica with n-gram speculation, one without, on the same model."""
    both = {"speculative": ReplicaProcess(extra_args=("--speculative-config", SPECULATIVE)),
            "plain": ReplicaProcess()}
    with running_replicas(list(both.values())):
        yield both


def _answer(replica: ReplicaProcess, prompt: str, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", timeout=120)
    kwargs = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
              "max_tokens": 48, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    return "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        **kwargs, stream=True) if chunk.choices)


def _counter(replica: ReplicaProcess, name: str) -> float:
    text = httpx.get(f"{replica.url}/metrics", timeout=30).text
    match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


@pytest.mark.parametrize("prompt", [QUOTING, OPEN], ids=["quoting", "open"])
def test_speculative_answers_equal_plain_ones(replicas: dict[str, ReplicaProcess], prompt: str) -> None:
    plain = _answer(replicas["plain"], prompt, stream=False)
    assert plain
    assert _answer(replicas["speculative"], prompt, stream=False) == plain
    assert _answer(replicas["speculative"], prompt, stream=True) == plain


def _per_position(replica: ReplicaProcess) -> list[float]:
    """``kvhive_spec_decode_num_accepted_tokens_per_pos_total`` by position."""
    text = httpx.get(f"{replica.url}/metrics", timeout=30).text
    found = re.findall(r'^kvhive_spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} '
                       r"([0-9.e+]+)$", text, re.M)
    return [value for _, value in sorted((int(p), float(v)) for p, v in found)]


def test_quoted_answers_accept_drafts(replicas: dict[str, ReplicaProcess]) -> None:
    speculative = replicas["speculative"]
    before = _counter(speculative, "kvhive_spec_decode_num_accepted_tokens_total")
    positions_before = _per_position(speculative)
    _answer(speculative, QUOTING, stream=False)
    accepted = _counter(speculative, "kvhive_spec_decode_num_accepted_tokens_total") - before
    assert accepted >= 8
    assert _counter(speculative, "kvhive_spec_decode_num_draft_tokens_total") >= accepted
    # One counter per draft position (k 4); a draft's later tokens are accepted only after its earlier ones.
    per_position = [a - b for a, b in zip(_per_position(speculative), positions_before, strict=True)]
    assert len(per_position) == 4 and sum(per_position) == accepted
    assert per_position == sorted(per_position, reverse=True) and per_position[-1] > 0
