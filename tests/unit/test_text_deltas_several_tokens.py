"""An engine output of several tokens (a speculative step's) becomes the same text, stop, counts,
ids and logprobs as the same tokens one output at a time: a stop string ends all of them at the
token that completed it."""

from __future__ import annotations

import pytest

from kvhive.engine.llm_engine import RequestOutput
from kvhive.engine.step import TokenLogprobs
from kvhive.request import FinishReason
from kvhive.server.text_deltas import DeltaAssembler, TextDelta

PROMPT = [1, 2, 3]


def outputs(token_ids: list[int], groups: list[int], finish: FinishReason) -> list[RequestOutput]:
    """The engine's outputs of ``token_ids`` in groups of the given sizes, the last one finished."""
    outs, start = [], 0
    for size in groups:
        part = token_ids[start:start + size]
        start += size
        last = start == len(token_ids)
        outs.append(RequestOutput("r", part, last, finish if last else None, len(PROMPT), 0, start,
                                  logprobs=tuple(TokenLogprobs(t, -0.5, ()) for t in part)))
    return outs


def final(tokenizer, outs: list[RequestOutput], stops: list[str]) -> tuple[str, TextDelta, list[int], int]:
    """The text, last delta, ids and logprob count the assembler hands out."""
    deltas = DeltaAssembler(tokenizer, PROMPT, stops, with_logprobs=True)
    text, ids, num_logprobs, last = "", [], 0, None
    for out in outs:
        delta = deltas.add(out)
        if delta is None:
            continue
        text, ids, num_logprobs, last = text + delta.text, ids + list(delta.token_ids), num_logprobs + len(delta.tokens), delta
        if delta.finish_reason is not None:
            break
    return text, last, ids, num_logprobs


@pytest.mark.parametrize("groups", [[3, 5, 4], [12], [1, 6, 5], [2, 2, 8]])
@pytest.mark.parametrize("stops", [["lazy"], ["fox jumps"], ["never there"], []])
def test_several_tokens_at_once_read_as_one_at_a_time(tokenizer, groups: list[int], stops: list[str]) -> None:
    token_ids = tokenizer.encode(" the quick brown fox jumps over the lazy dog again and again")[:12]
    assert len(token_ids) == 12
    one_by_one = final(tokenizer, outputs(token_ids, [1] * 12, FinishReason.LENGTH), stops)
    grouped = final(tokenizer, outputs(token_ids, groups, FinishReason.LENGTH), stops)
    assert grouped[0] == one_by_one[0]
    assert grouped[1].finish_reason == one_by_one[1].finish_reason
    assert grouped[1].num_output_tokens == one_by_one[1].num_output_tokens
    assert grouped[2] == one_by_one[2] and grouped[3] == one_by_one[3]
    if stops == ["lazy"]:
        assert grouped[1].finish_reason == "stop" and grouped[1].num_output_tokens < 12
