"""The scheduler's side of speculative decoding: which requests draft, their drafts, the counters.

A running request in decode drafts unless it asks for prompt logprobs: those decode one token per
step. A request of a disaggregated transfer (``--kv-role``) drafts like any other once its prompt
is computed: a transfer carries prompt blocks only. Method "ngram" drafts from the request's own
tokens; method "history" does so first and, where they give no draft, drafts from
the tokens of its tenant's other running requests (the ``MAX_LIVE_PEERS`` that started decoding
last; a tenant is a prefix-cache salt), then from its tenant's ``HistoryStore`` (the prompt and
output of every finished request). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.speculative.acceptance_prior import AcceptancePriors
from kvhive.engine.speculative.draft_length import DraftLength
from kvhive.engine.speculative.ngram_index import NgramIndex
from kvhive.engine.speculative.tenant_history import HistoryStats, HistoryStore
from kvhive.request import Request

# Method "history": the most running requests of the tenant a step looks its suffix up in.
MAX_LIVE_PEERS = 8


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start: steps that verified drafts, draft tokens verified, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Method "history": the draft tokens verified that came from the tenant's running requests or
    # its history store, and accepted.
    num_history_draft_tokens: int = 0
    num_history_accepted_tokens: int = 0
    # Per draft position j (0: the first draft token of a step): the times a draft token at j was
    # accepted; one entry per position up to num_speculative_tokens.
    num_accepted_tokens_per_pos: tuple[int, ...] = ()


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens may be drafted (see the module's docstring)."""
    return request.sampling.prompt_logprobs is None


class _RequestDrafts:
    """One request's n-gram index, adaptive draft length and draft tokens verified and accepted."""

    def __init__(self, config: SpeculativeConfig, rate: float) -> None:
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.length = DraftLength(config.num_speculative_tokens, rate, config.prompt_lookup_min,
                                  config.prompt_lookup_max)
        self.from_history = False       # whether its latest draft came from other requests' tokens
        self.num_proposed = self.num_accepted = 0


class DraftProposer:
    """Per-request drafting state, kept from a request's first decode step until it finishes, and
    each tenant's acceptance prior, which a request starts from."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._requests: dict[str, _RequestDrafts] = {}
        self.priors = AcceptancePriors()
        # Method "history": the running requests' states by tenant, in the order they started decoding.
        self._live: dict[str | None, dict[str, _RequestDrafts]] = {}
        self._num_drafts = self._num_draft_tokens = self._num_accepted = 0
        self._num_history_draft_tokens = self._num_history_accepted = 0
        self._accepted_per_pos = [0] * config.num_speculative_tokens
        self.history = None if config.method != "history" else HistoryStore(
            config.prompt_lookup_min, config.prompt_lookup_max, config.history_max_tokens,
            config.history_tenant_max_tokens)

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow the request's tokens ([]: a plain step)."""
        if max_tokens <= 0 or not can_speculate(request):
            return []
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestDrafts(
                self.config, self.priors.prior(request.cache_salt))
            if self.history is not None:
                self._live.setdefault(request.cache_salt, {})[request.request_id] = state
        state.index.extend(request.all_token_ids[len(state.index):])
        length = min(state.length.next_length(), max_tokens)
        if length <= 0:
            return []
        min_match = state.length.min_match
        drafts = state.index.propose(length, min_match)
        state.from_history = not drafts and self.history is not None
        if state.from_history:
            drafts = (self._live_proposal(request, state, length, min_match)
                      or self.history.propose(request.cache_salt, state.index.tokens, length, min_match))
        return drafts

    def _live_proposal(self, request: Request, state: _RequestDrafts, length: int,
                       min_match: int) -> list[int]:
        """A draft from the tokens of the tenant's other running requests, latest first ([]: none)."""
        peers = self._live.get(request.cache_salt, {})
        others = (peer for rid, peer in reversed(peers.items()) if rid != request.request_id)
        for peer in islice(others, MAX_LIVE_PEERS):
            drafts = peer.index.follow(state.index.tokens, length, min_match)
            if drafts:
                return drafts
        return []

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Count one verified step of a request and adapt its draft length."""
        self._num_drafts += 1
        self._num_draft_tokens += num_proposed
        self._num_accepted += num_accepted
        for j in range(min(num_accepted, len(self._accepted_per_pos))):
            self._accepted_per_pos[j] += 1
        state = self._requests.get(request_id)
        if state is not None:
            state.length.record(num_proposed, num_accepted)
            state.num_proposed += num_proposed
            state.num_accepted += num_accepted
            if state.from_history:
                self._num_history_draft_tokens += num_proposed
                self._num_history_accepted += num_accepted

    def finish(self, request: Request) -> None:
        """Drop a finished request's state, folding its drafts' outcome into its tenant's prior;
        with method "history", keep its prompt and output for its tenant's later drafts."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self.priors.record(request.cache_salt, state.num_proposed, state.num_accepted)
        peers = self._live.get(request.cache_salt)
        if peers is not None and peers.pop(request.request_id, None) is not None and not peers:
            del self._live[request.cache_salt]
        if self.history is not None:
            self.history.record(request.cache_salt, request.all_token_ids)

    def history_stats(self) -> HistoryStats | None:
        """What the history store holds (None unless the method is "history")."""
        return None if self.history is None else self.history.stats()

    def chances(self, request_id: str, n: int) -> list[float]:
        """The chance that each of the request's next ``n`` draft tokens is accepted
        (``DraftLength.chances``; a request that never drafted: none)."""
        state = self._requests.get(request_id)
        return [] if state is None else state.length.chances(n)

    def draft_length(self, request_id: str) -> DraftLength | None:
        """The request's adaptive draft length (None before its first decode step); for tests and stats."""
        state = self._requests.get(request_id)
        return None if state is None else state.length

    def stats(self) -> SpecDecodeStats:
        """The counters since start."""
        return SpecDecodeStats(self._num_drafts, self._num_draft_tokens, self._num_accepted,
                               self._num_history_draft_tokens, self._num_history_accepted,
                               tuple(self._accepted_per_pos))
