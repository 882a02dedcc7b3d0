"""Prompt-logprobs spans: which prompt rows each chunk reports, none of them twice."""

from __future__ import annotations

from support.scheduler_parts import make_request

from kvhive.engine.scheduler.prompt_logprobs import prompt_logprobs_span, record_prompt_rows
from kvhive.engine.step import PromptLogprobsSpan

PROMPT = list(range(100, 110))      # P = 10: rows 0..8 report, row 9 samples


def test_a_request_without_prompt_logprobs_reports_nothing():
    assert prompt_logprobs_span(make_request("r", PROMPT), 0, 10) is None


def test_chunks_report_their_rows_and_the_last_row_samples():
    r = make_request("r", PROMPT, prompt_logprobs=2)
    assert prompt_logprobs_span(r, 0, 4) == PromptLogprobsSpan(0, tuple(PROMPT[1:5]), 2)
    assert prompt_logprobs_span(r, 4, 10) == PromptLogprobsSpan(4, tuple(PROMPT[5:10]), 2)


def test_a_recomputed_chunk_reports_only_rows_not_yet_reported():
    r = make_request("r", PROMPT, prompt_logprobs=1)
    record_prompt_rows(r, prompt_logprobs_span(r, 0, 6))
    assert r.num_prompt_logprob_rows == 6
    assert prompt_logprobs_span(r, 0, 4) is None               # after a preemption: all reported
    assert prompt_logprobs_span(r, 0, 8) == PromptLogprobsSpan(6, tuple(PROMPT[7:9]), 1)


def test_once_every_row_is_reported_nothing_more_and_hits_are_allowed_again():
    r = make_request("r", PROMPT, prompt_logprobs=1)
    assert r.needs_prompt_rows
    record_prompt_rows(r, prompt_logprobs_span(r, 0, 10))
    assert r.num_prompt_logprob_rows == 9 and not r.needs_prompt_rows
    assert prompt_logprobs_span(r, 0, 10) is None


def test_recording_no_span_changes_nothing():
    r = make_request("r", PROMPT, prompt_logprobs=1)
    record_prompt_rows(r, None)
    assert r.num_prompt_logprob_rows == 0
