"""Prompt logprobs: which prompt rows each chunk reports, and how many have gone out.

A request asking for prompt logprobs needs the logits of every prompt row. Row ``p`` scores
prompt token ``p + 1``, so rows ``0 .. P - 2`` report and row ``P - 1`` samples the first output
token. ``request.num_prompt_logprob_rows`` counts the rows reported so far; a chunk recomputed
after a preemption reports none of them twice.
"""

from __future__ import annotations

from kvhive.engine.step import PromptLogprobsSpan
from kvhive.request import Request


def prompt_logprobs_span(request: Request, start: int, end: int) -> PromptLogprobsSpan | None:
    """The rows of chunk [start, end) whose prompt logprobs have not gone out; None for most requests."""
    if not request.needs_prompt_rows:
        return None
    first = max(start, request.num_prompt_logprob_rows)
    last = min(end, request.num_prompt_tokens - 1)     # row P - 1 scores the first output token
    if first >= last:
        return None
    return PromptLogprobsSpan(first, tuple(request.prompt_token_ids[first + 1:last + 1]),
                              request.sampling.prompt_logprobs)


def record_prompt_rows(request: Request, span: PromptLogprobsSpan | None) -> None:
    """Count the rows of an applied step's ``span`` as reported (no change when ``span`` is None)."""
    if span is not None:
        request.num_prompt_logprob_rows = span.first_pos + len(span.next_token_ids)
