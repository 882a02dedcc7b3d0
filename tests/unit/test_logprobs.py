"""Logprobs of sampled tokens without a model: the computation against torch.log_softmax, their
bounds, and the server's parts (which tokens go out with which text, the seeds of n choices). In
the engine and with the default model's token strings: tests/engine/test_logprobs_engine.py."""

from __future__ import annotations

import math

import pytest
import torch

from kvhive.engine.sampling import token_logprobs
from kvhive.engine.step import TokenLogprobs
from kvhive.request import MAX_LOGPROBS, SamplingParams
from kvhive.server.choices import choice_seed
from kvhive.server.logprobs import SentToken, TokensAwaitingText


def test_token_logprobs_equal_log_softmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    tokens = [3, 7, 0, 49]
    out = token_logprobs(logits, tokens, [5, None, 0, 50])
    ref = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    for i in (0, 2, 3):
        assert out[i].token_id == tokens[i]
        assert out[i].logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-6)
    values, ids = ref[0].topk(5)
    assert [t for t, _ in out[0].top] == ids.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out[2].top == ()
    assert len(out[3].top) == 50 and sum(math.exp(v) for _, v in out[3].top) == pytest.approx(1.0, abs=1e-5)
    assert token_logprobs(logits, tokens, [None] * 4) == [None] * 4


def test_sampling_params_bound_logprobs() -> None:
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


def lp(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -1.0, ())


def test_a_token_goes_out_with_the_start_of_its_text() -> None:
    awaiting = TokensAwaitingText()
    awaiting.add([lp(1)], "ab")
    assert awaiting.release(0) == ()             # "ab" held back (it could start a stop string)
    assert awaiting.release(1) == (SentToken(lp(1), 0),)   # "a" went out: the token goes with it
    awaiting.add([lp(2)], "")                    # first bytes of a character: no text yet
    assert awaiting.release(2) == ()
    awaiting.add([lp(3)], "日")                  # completes it
    assert awaiting.release(3) == (SentToken(lp(2), 2), SentToken(lp(3), 2))
    awaiting.add([lp(4)], "")                    # the end-of-turn token: no text at all
    assert awaiting.release(3) == ()
    assert awaiting.release_all() == (SentToken(lp(4), 3),)


def test_a_stop_string_drops_the_tokens_none_of_whose_text_went_out() -> None:
    awaiting = TokensAwaitingText()
    for token_id, text in ((1, "ab"), (2, "cd"), (3, ""), (4, "ef")):
        awaiting.add([lp(token_id)], text)
    # Cut at 3 characters: token 2 ("cd") is split by the cut, so it stays; 3 and 4 come after it.
    assert awaiting.release(3) == (SentToken(lp(1), 0), SentToken(lp(2), 2))
    awaiting = TokensAwaitingText()
    for token_id, text in ((1, "ab"), (2, ""), (3, "cd")):
        awaiting.add([lp(token_id)], text)
    assert awaiting.release(2) == (SentToken(lp(1), 0),)   # token 2 starts at the cut


def test_choice_seeds_are_distinct_and_stable() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(1, 16)]
    assert len(set(seeds)) == 15 and 7 not in seeds
    assert seeds == [choice_seed(7, i) for i in range(1, 16)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(8, 1) not in seeds
