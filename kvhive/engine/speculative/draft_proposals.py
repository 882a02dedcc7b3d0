"""The scheduler's side of speculative decoding: which requests draft, their drafts, the counters.

A running request in decode drafts unless it asks for prompt logprobs or is part of a
disaggregated KV transfer: those decode one token per step. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.speculative.draft_length import DraftLength
from kvhive.engine.speculative.ngram_index import NgramIndex
from kvhive.request import Request


@dataclass(frozen=True)
class SpecDecodeStats:
    """Counters since start: steps that verified drafts, draft tokens verified, drafts accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens may be drafted (see the module's docstring)."""
    sampling = request.sampling
    return sampling.prompt_logprobs is None and request.kv_transfer is None


class _RequestDrafts:
    """One request's n-gram index and adaptive draft length."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        self.length = DraftLength(config.num_speculative_tokens)


class DraftProposer:
    """Per-request drafting state, kept from a request's first decode step until it finishes."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._requests: dict[str, _RequestDrafts] = {}
        self._num_drafts = self._num_draft_tokens = self._num_accepted = 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens to follow the request's tokens ([]: a plain step)."""
        if max_tokens <= 0 or not can_speculate(request):
            return []
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestDrafts(self.config)
        state.index.extend(request.all_token_ids[len(state.index):])
        length = min(state.length.next_length(), max_tokens)
        return state.index.propose(length) if length > 0 else []

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """Count one verified step of a request and adapt its draft length."""
        self._num_drafts += 1
        self._num_draft_tokens += num_proposed
        self._num_accepted += num_accepted
        state = self._requests.get(request_id)
        if state is not None:
            state.length.record(num_proposed, num_accepted)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._requests.pop(request_id, None)

    def draft_length(self, request_id: str) -> DraftLength | None:
        """The request's adaptive draft length (None before its first decode step); for tests and stats."""
        state = self._requests.get(request_id)
        return None if state is None else state.length

    def stats(self) -> SpecDecodeStats:
        """The counters since start."""
        return SpecDecodeStats(self._num_drafts, self._num_draft_tokens, self._num_accepted)
