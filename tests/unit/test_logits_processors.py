"""The sampling extras' math (``kvhive.engine.logits_processors``) against transformers' logits
processors and OpenAI's definitions, batched with rows that use none; the scheduler's side of the
token history (handed over once, across preemption and prefix hits); SamplingParams' bounds."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from kvhive.engine.logits_processors import LogitsProcessors
from kvhive.engine.scheduler.sampling_inputs import suppressed_tokens, token_history
from kvhive.engine.step import ScheduledSeq, TokenHistory
from kvhive.request import MAX_LOGIT_BIAS_TOKENS, Request, SamplingParams

VOCAB = 64


def seq(request_id: str, sampling: SamplingParams, history: TokenHistory | None = None,
        suppress: tuple[int, ...] = ()) -> ScheduledSeq:
    """A sampled one-token chunk carrying ``history`` and ``suppress``."""
    return ScheduledSeq(request_id, [1], 0, [0], True, sampling, history=history, suppress_token_ids=suppress)


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


def test_no_extras_returns_the_same_tensor() -> None:
    logits = logits_of(3)
    seqs = [seq(str(i), SamplingParams()) for i in range(3)]
    assert LogitsProcessors(torch.device("cpu")).apply(logits, seqs) is logits


def test_repetition_penalty_matches_transformers_over_prompt_and_output() -> None:
    prompt, output = [3, 5, 5, 9], [9, 11, 2]
    logits = logits_of(2)
    logits[0, 3], logits[0, 11] = 2.5, -1.5            # a positive and a negative seen logit
    processors = LogitsProcessors(torch.device("cpu"))
    history = TokenHistory(0, tuple(prompt + output), len(prompt))
    rows = [seq("p", SamplingParams(repetition_penalty=1.3), history), seq("plain", SamplingParams())]
    got = processors.apply(logits, rows)
    reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[:1].clone())
    torch.testing.assert_close(got[0], reference[0])
    torch.testing.assert_close(got[1], logits[1])        # the row without extras is untouched
    assert got[0, 3] == pytest.approx(2.5 / 1.3) and got[0, 11] == pytest.approx(-1.5 * 1.3)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    prompt, output = [4, 4, 7], [7, 8, 8, 8]
    logits = logits_of(1)
    processors = LogitsProcessors(torch.device("cpu"))
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)
    got = processors.apply(logits, [seq("r", params, TokenHistory(0, tuple(prompt + output), 3))])
    expected = logits[0].clone()
    for token, count in {7: 1, 8: 3}.items():          # OpenAI: mu - c * alpha_freq - (c > 0) * alpha_pres
        expected[token] -= count * 0.5 + 1.25
    torch.testing.assert_close(got[0], expected)        # 4 is only in the prompt: unpenalized


def test_history_is_incremental_and_idempotent() -> None:
    processors = LogitsProcessors(torch.device("cpu"))
    params = SamplingParams(frequency_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    processors.apply(logits, [seq("r", params, TokenHistory(0, (1, 2, 3), 3))])
    # A row retried alone hands the same history again: nothing is counted twice.
    processors.apply(logits, [seq("r", params, TokenHistory(0, (1, 2, 3), 3))])
    got = processors.apply(logits, [seq("r", params, TokenHistory(3, (6,), 3))])
    got = processors.apply(logits, [seq("r", params, TokenHistory(4, (6,), 3))])
    assert got[0, 6] == -2.0 and got[0, 1] == 0.0
    with pytest.raises(ValueError, match="jumps"):
        processors.apply(logits, [seq("r", params, TokenHistory(9, (6,), 3))])
    processors.release(["r"])
    assert processors.num_histories() == 0


def test_min_p_matches_transformers_at_the_rows_temperature() -> None:
    logits = logits_of(3, seed=1)
    params = [SamplingParams(min_p=0.1), SamplingParams(min_p=0.3, temperature=0.7), SamplingParams()]
    got = LogitsProcessors(torch.device("cpu")).apply(logits, [seq(str(i), p) for i, p in enumerate(params)])
    for row, (min_p, temperature) in enumerate([(0.1, 1.0), (0.3, 0.7)]):
        reference = MinPLogitsWarper(min_p)(None, logits[row:row + 1] / temperature)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(reference[0]))
        kept = ~torch.isinf(got[row])
        torch.testing.assert_close(got[row][kept], logits[row][kept])
    torch.testing.assert_close(got[2], logits[2])
    # A greedy row keeps its logits: min_p never changes the argmax.
    greedy = LogitsProcessors(torch.device("cpu")).apply(logits[:1], [seq("g", SamplingParams(min_p=0.5, temperature=0))])
    assert greedy is logits[:1] or torch.equal(greedy, logits[:1])


def test_logit_bias_adds_and_suppressed_tokens_never_win() -> None:
    logits = logits_of(2, seed=2)
    params = SamplingParams(logit_bias=((5, 100.0), (6, -100.0)))
    got = LogitsProcessors(torch.device("cpu")).apply(logits, [seq("b", params), seq("s", SamplingParams(), suppress=(0, 9))])
    assert got[0, 5] == pytest.approx(logits[0, 5] + 100) and got[0, 6] == pytest.approx(logits[0, 6] - 100)
    assert int(got[0].argmax()) == 5
    assert got[1, 0] == float("-inf") and got[1, 9] == float("-inf")
    torch.testing.assert_close(got[1, 1:9], logits[1, 1:9])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitsProcessors(torch.device("cpu")).apply(logits[:1], [seq("b", SamplingParams(logit_bias=((VOCAB, 1.0),)))])


def test_scheduler_hands_each_token_over_once() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(repetition_penalty=1.2, max_tokens=8))
    first = token_history(request)
    assert first == TokenHistory(0, (1, 2, 3), 3)
    assert token_history(request) is None               # resumed after preemption: nothing new
    request.append_output_token(7)
    assert token_history(request) == TokenHistory(3, (7,), 3)
    assert token_history(Request("q", [1], SamplingParams())) is None     # no penalty: no history


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=(5,))
    request = Request("r", [1], params, eos_token_ids=(0,))
    assert suppressed_tokens(request) == (0, 5)
    request.append_output_token(3)
    request.append_output_token(4)
    assert suppressed_tokens(request) == ()
    ignoring = Request("i", [1], SamplingParams(min_tokens=1, ignore_eos=True), eos_token_ids=(0,))
    assert suppressed_tokens(ignoring) == ()


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0.0), ("repetition_penalty", 10.5), ("presence_penalty", 2.1),
    ("frequency_penalty", -2.5), ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", 17), ("min_tokens", -1),
    ("logit_bias", ((1, 101.0),)), ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS_TOKENS + 1))),
    ("repetition_penalty", float("nan")), ("min_p", float("nan")),
])
def test_sampling_extras_bounds(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})
