"""What the scheduler hands the runner each step, and what comes back (plain data, torch-free).

The scheduler never imports the runner and the runner never imports the scheduler: these types are
the whole contract between them, and the engine is the one place that passes one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvhive.request import SamplingParams

if TYPE_CHECKING:
    from kvhive.connector.base import ConnectorMeta
    from kvhive.kv.partial_copies import BlockCopy


@dataclass(frozen=True)
class PromptLogprobsSpan:
    """Prompt logprobs one chunk reports: rows at positions ``first_pos``.. (one per entry of
    ``next_token_ids``), row p scored against prompt token p + 1, with ``num_top`` alternatives."""

    first_pos: int
    next_token_ids: tuple[int, ...]
    num_top: int


@dataclass(frozen=True)
class TokenHistory:
    """Tokens of a request the runner has not been handed yet, for its penalties: positions
    ``start``.. of prompt + output (the first ``num_prompt_tokens`` positions are the prompt). Each
    token goes to the runner once; the runner keeps them until the request finishes, so a history
    survives preemption, chunked prefill and prefix-cache hits (positions it never computed)."""

    start: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: compute ``token_ids`` at positions start_pos.. and maybe sample.

    ``block_table`` lists the request's pool blocks in order; token at position p lives in slot
    ``block_table[p // block_size] * block_size + p % block_size``. Positions < start_pos are
    already in the pool (earlier steps or prefix-cache hits) and are attended to, not recomputed.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool                      # True when this chunk reaches the end of the known tokens
    sampling: SamplingParams
    # Tokens generated so far (for penalties and seeded generators); empty during prefill.
    num_output_tokens: int = 0
    # The prompt logprobs this chunk reports (None: none, the common case).
    prompt_logprobs: PromptLogprobsSpan | None = None
    # The window layers' blocks, entry i beside block_table[i] (0 where released); None: one pool.
    window_table: list[int] | None = None
    # On a sampled chunk of a request with a penalty: its tokens the runner lacks (None otherwise).
    history: TokenHistory | None = None
    # Tokens this step must not sample (EOS and stop_token_ids while min_tokens is not reached).
    suppress_token_ids: tuple[int, ...] = ()
    # Speculative decoding: the last ``len(draft_token_ids)`` entries of token_ids are drafts; every
    # row from the request's last known token on is scored and the drafts verified (sample is True).
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        """Tokens computed in this step."""
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step: cached + new."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """Everything the runner needs for one forward pass."""

    seqs: list[ScheduledSeq]
    # Requests that ended since the last plan: the runner drops their per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # KV transfers for the connector's worker half (None: nothing to move this step). A plan may
    # carry transfers and no seqs; the engine still hands it to the runner.
    connector_meta: ConnectorMeta | None = None
    # Partial-block prefix hits: token slots the runner copies between pool blocks before the
    # forward pass (into blocks of requests this plan admits).
    block_copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step across all sequences."""
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.seqs

    @property
    def decode_rows_only(self) -> bool:
        """True when every sequence computes only its last known token and its drafts (no prefill
        chunk): the rows whose cost speculation sizes drafts by."""
        return bool(self.seqs) and all(s.num_new_tokens == 1 + len(s.draft_token_ids) for s in self.seqs)


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the most likely tokens at its position.

    Values are the log-softmax of the model's raw float32 logits, before temperature, top-k and
    top-p; ``top`` is (token id, logprob) pairs, most likely first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class EmittedTokens(NamedTuple):
    """The tokens a step gave one request, in order, and their logprobs (None unless asked)."""

    token_ids: list[int]
    logprobs: tuple[TokenLogprobs, ...] | None


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens, one per sequence whose ``sample`` flag was set, the logprobs of the
    sequences whose sampling params asked for them, and the prompt logprobs of the chunks that
    carried a ``PromptLogprobsSpan`` (one entry per row of the span, in order).

    A sequence whose own row could not be computed (its sampling or logprobs raised) is in
    ``failed`` with the error instead of ``sampled``; the request then ends with an error while
    the others go on. A structured request whose grammar this step's token completed is in
    ``completed``: it ends with STOP.

    A sequence with drafts emits ``accepted_drafts[id]`` (its drafts the target model accepted,
    in order, absent when none) and then ``sampled[id]``; ``accepted_logprobs[id]`` holds the
    accepted drafts' logprobs where the request asks for them."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    completed: frozenset[str] = frozenset()
    accepted_drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    accepted_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)

    def emitted(self, request_id: str, num_kept: int | None = None) -> EmittedTokens:
        """The request's tokens from this step: its sampled token, after its accepted drafts if it
        had any; ``num_kept``: the first so many only (a stop ended the request mid-draft)."""
        token = self.sampled.get(request_id)
        if token is None:
            return EmittedTokens([], None)
        value = self.logprobs.get(request_id)
        tokens = [*self.accepted_drafts.get(request_id, ()), token][:num_kept]
        if value is None:
            return EmittedTokens(tokens, None)
        return EmittedTokens(tokens, (*self.accepted_logprobs.get(request_id, ()), value)[:num_kept])
