"""The runner's side of speculative decoding: the target model's verdict on a sequence's drafts.

A sequence with m drafts is scored at m + 1 rows: its last known token's and each draft's. Row j
gives the distribution of the token after draft j - 1, after the request's own logits processing
as a plain step would do it there (``LogitsProcessors.apply_drafted``: the penalties count the
drafts before the row, ``min_tokens`` suppresses EOS at the rows still short of it). Strict acceptance: row j's token is picked as a plain step
would (the argmax, or a draw from the request's sampling distribution with its own generator);
while it equals draft j the draft is accepted and row j + 1 is read, at the first difference (or
after the last draft) the picked token is emitted and verification stops. Each emitted token is
exactly what a plain step would have picked given the same tokens before it, and a seeded
generator draws once per emitted token, as in plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvhive.engine.constrained import GrammarRows
from kvhive.engine.logits_processors import LogitsProcessors
from kvhive.engine.request_errors import NO_TOKEN, grammar_failure
from kvhive.engine.sampling import argmax_rows, check_logits, sample_tokens, token_logprobs
from kvhive.engine.step import ScheduledSeq, StepResult, TokenLogprobs
from kvhive.request import SamplingParams
from kvhive.structured import GrammarMatcher


@dataclass(frozen=True)
class VerifiedDrafts:
    """What one sequence emits: its accepted drafts, then the target model's own token (last);
    with their logprobs (one per token) where the request asks for them, else ()."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    completed: bool = False          # a structured output that its last token completed

    @property
    def num_accepted(self) -> int:
        """Drafts accepted (every token but the last)."""
        return len(self.token_ids) - 1


@dataclass(frozen=True)
class SampleRowLayout:
    """Where a step's sampled seqs sit among the sampled rows: one row per plain seq, and for each
    seq with drafts the index of its first row (its rows follow in order)."""

    plain_rows: list[int]
    drafted: list[tuple[ScheduledSeq, int]]


def sample_row_layout(sampled: Sequence[ScheduledSeq]) -> SampleRowLayout:
    """The layout of the sampled rows of ``sampled`` (the seqs with sample=True, in batch order)."""
    plain: list[int] = []
    drafted: list[tuple[ScheduledSeq, int]] = []
    row = 0
    for s in sampled:
        if s.draft_token_ids:
            drafted.append((s, row))
            row += 1 + len(s.draft_token_ids)
        else:
            plain.append(row)
            row += 1
    return SampleRowLayout(plain, drafted)


def accept_drafts(logits: torch.Tensor, drafts: Sequence[int], sampling: SamplingParams,
                  generator: torch.Generator | None) -> tuple[int, ...]:
    """The tokens emitted for ``drafts`` given the processed ``logits`` [len(drafts) + 1, vocab]:
    the accepted drafts, then the token picked where the first draft differs (or after the last)."""
    picks = argmax_rows(logits) if sampling.greedy else None
    out: list[int] = []
    for j in range(len(drafts) + 1):
        token = picks[j] if picks is not None else sample_tokens(logits[j:j + 1], [sampling], [generator])[0]
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return tuple(out)


def verify_drafts(logits: torch.Tensor, seq: ScheduledSeq, processors: LogitsProcessors,
                  generator: torch.Generator | None, grammar: GrammarRows | None = None) -> VerifiedDrafts:
    """Verify ``seq``'s drafts on its raw ``logits`` rows [1 + m, vocab]; logprobs (of the raw
    logits, as for a plain step) of each emitted token where the request asks for them. A
    structured seq's rows are masked by its grammar at each row's position first (``grammar``;
    drafts past one the grammar refuses or that completes the output are not verified), and its
    matcher then takes the emitted tokens."""
    drafts = seq.draft_token_ids
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"request {seq.request_id}: {logits.shape[0]} rows for {len(drafts)} drafts")
    check_logits(logits)
    matcher, masked = None, logits
    if seq.sampling.structured is not None:
        matcher, masked = _grammar_masked(logits, seq, grammar)
        drafts = drafts[:masked.shape[0] - 1]
    used = replace(seq, draft_token_ids=drafts)
    tokens = accept_drafts(processors.apply_drafted(masked, used), drafts, seq.sampling, generator)
    completed = False
    if matcher is not None:
        for token in tokens:
            if not matcher.accept(token):
                raise ValueError(grammar_failure(matcher, token))
        completed = matcher.is_complete
    num_top = seq.sampling.logprobs
    if num_top is None:
        return VerifiedDrafts(tokens, completed=completed)
    values = token_logprobs(logits[:len(tokens)], tokens, [num_top] * len(tokens))
    return VerifiedDrafts(tokens, tuple(v for v in values if v is not None), completed)


def _grammar_masked(logits: torch.Tensor, seq: ScheduledSeq, grammar: GrammarRows | None
                    ) -> tuple[GrammarMatcher, torch.Tensor]:
    """The structured seq's matcher and its rows of ``logits`` masked by the grammar (as many rows
    as ``GrammarRows.draft_masks`` gives); ValueError where the spec cannot be followed."""
    if grammar is None:
        raise ValueError("this engine has no grammar compiler for structured outputs")
    failed: dict[str, str] = {}
    matcher = grammar.matcher_for(seq, failed)
    if matcher is None:
        raise ValueError(failed[seq.request_id])
    if matcher.error is not None:
        raise ValueError(grammar_failure(matcher))
    blocked = grammar.draft_masks(matcher, seq.draft_token_ids)
    if blocked[0].all():
        raise ValueError(NO_TOKEN)
    rows = logits[:blocked.shape[0]]
    return matcher, rows.masked_fill(torch.from_numpy(blocked).to(rows.device), float("-inf"))


def drafted_result(result: StepResult, verified: dict[str, VerifiedDrafts]) -> StepResult:
    """``result`` (the plain seqs') with the verified seqs' tokens and logprobs added (those in
    ``result.failed`` left out)."""
    if not verified:
        return result
    kept = {rid: v for rid, v in verified.items() if rid not in result.failed}
    sampled = {**result.sampled, **{rid: v.token_ids[-1] for rid, v in kept.items()}}
    logprobs = {**result.logprobs, **{rid: v.logprobs[-1] for rid, v in kept.items() if v.logprobs}}
    completed = result.completed | {rid for rid, v in kept.items() if v.completed}
    return replace(result, sampled=sampled, logprobs=logprobs, completed=frozenset(completed),
                   accepted_drafts={rid: v.token_ids[:-1] for rid, v in kept.items() if v.num_accepted},
                   accepted_logprobs={rid: v.logprobs[:-1] for rid, v in kept.items()
                                      if v.logprobs and v.num_accepted})
