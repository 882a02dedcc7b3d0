"""A request's engine outputs as text: ``TextDelta``s (text, counts, logprobs, ids), the options
that shape the text, the ``DeltaAssembler`` that detokenizes and matches stop strings, and the
usage of a request's choices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvhive.core.tokenizer import IncrementalDetokenizer
from kvhive.engine.llm_engine import RequestOutput
from kvhive.engine.step import TokenLogprobs
from kvhive.server.logprobs import SentToken, TokensAwaitingText
from kvhive.server.protocol import PromptTokensDetails, SamplingRequest, Usage
from kvhive.server.stop import StopStringMatcher

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextDelta:
    """Text produced since the previous delta; ``finish_reason`` is set on the last one."""

    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # The tokens whose text is in this delta, when the request asked for logprobs.
    tokens: tuple[SentToken, ...] = ()
    # On the first delta of a request that asked for prompt logprobs: the prompt tokens' after the
    # first (``RequestOutput.prompt_logprobs``).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # The ids the engine generated since the previous delta (``return_token_ids``).
    token_ids: tuple[int, ...] = ()
    # On the last delta of a request with a retention: its full blocks' hashes, as far as the
    # engine reported them (``RequestOutput.block_hashes``); None otherwise.
    block_hashes: tuple[bytes, ...] | None = None

    def usage(self) -> Usage:
        """OpenAI usage as of this delta."""
        return combined_usage([self])


def combined_usage(finals: Sequence[TextDelta]) -> Usage:
    """Usage of a request's choices (their last deltas): the prompt counted once, with the cached
    tokens the first choice found; completion tokens summed over the choices."""
    first = finals[0]
    completion = sum(d.num_output_tokens for d in finals)
    return Usage(prompt_tokens=first.num_prompt_tokens, completion_tokens=completion,
                 total_tokens=first.num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens))



@dataclass(frozen=True)
class TextOptions:
    """How a request's tokens become its text (vLLM's fields): special tokens dropped or written out,
    a matched stop string kept at the end of the text or cut."""

    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def of(cls, body: SamplingRequest) -> TextOptions:
        """The options a completion or chat request asks for."""
        return cls(body.skip_special_tokens, body.include_stop_str_in_output)


# The options of a request that asks for none: special tokens dropped, a matched stop string cut.
PLAIN_TEXT = TextOptions()




class DeltaAssembler:
    """Turns one request's engine outputs into ``TextDelta``s: incremental detokenization, stop
    strings (looked for once more than ``min_tokens`` tokens were generated, as vLLM does), the
    logprobs of the tokens whose text went out, the prompt logprobs on the first delta."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop_strings: Sequence[str],
                 with_logprobs: bool, text: TextOptions = PLAIN_TEXT, min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                   skip_special_tokens=text.skip_special_tokens)
        self._matcher = StopStringMatcher(stop_strings, include_stop=text.include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._awaiting = TokensAwaitingText() if with_logprobs else None
        self._num_sent = 0                            # characters of text handed out so far
        self._prompt_logprobs: tuple[TokenLogprobs, ...] | None = None   # until a delta carries them
        self._new_ids: list[int] = []                 # generated since the previous delta
        # Token counts as of the latest output: prompt, cached (never negative), output.
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = len(prompt_token_ids), 0, 0

    def add(self, out: RequestOutput) -> TextDelta | None:
        """The delta of one engine output: the last one (its finish reason set) once a stop string
        matched or the engine finished the request; None while no new text is ready to send.

        An output of several tokens (a speculative step's) is read token by token, so a stop
        string ends the text, the tokens and the counts where a token at a time would have."""
        if len(out.new_token_ids) > 1 and self._matcher.has_stops:
            return self._add_each(out)
        return self._add_one(out)

    def _add_each(self, out: RequestOutput) -> TextDelta | None:
        """``add`` for each token of ``out`` in turn, their deltas merged, up to a stop string's."""
        n = len(out.new_token_ids)
        merged: TextDelta | None = None
        for i, token in enumerate(out.new_token_ids):
            last = i == n - 1
            part = replace(out, new_token_ids=[token], logprobs=None if out.logprobs is None else (out.logprobs[i],),
                           finished=out.finished and last, finish_reason=out.finish_reason if last else None,
                           num_output_tokens=out.num_output_tokens - (n - 1 - i),
                           prompt_logprobs=out.prompt_logprobs if i == 0 else None)
            delta = self._add_one(part)
            if delta is not None:
                merged = delta if merged is None else replace(
                    delta, text=merged.text + delta.text, tokens=merged.tokens + delta.tokens,
                    token_ids=merged.token_ids + delta.token_ids,
                    prompt_logprobs=merged.prompt_logprobs or delta.prompt_logprobs)
                if delta.finish_reason is not None:
                    break
        return merged

    def _add_one(self, out: RequestOutput) -> TextDelta | None:
        """``add`` for an output read as a whole."""
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = max(0, out.num_cached_tokens)
        self.num_output_tokens = out.num_output_tokens
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        self._new_ids.extend(out.new_token_ids)
        text = self._new_text(out)
        if self._matcher.stopped:
            # Logprobs of the tokens whose text, or part of it, went out before the stop string.
            return self._delta(text, "stop", self._release(self._num_sent))
        if out.finished:
            text += self._matcher.flush()
            reason = out.finish_reason.value if out.finish_reason else "stop"
            return self._delta(text, reason, () if self._awaiting is None else self._awaiting.release_all())
        if not text:
            return None
        return self._delta(text, None, self._release(self._num_sent))

    def _new_text(self, out: RequestOutput) -> str:
        """The output's new text up to any stop string (held back while it may start one)."""
        text = self._detokenizer.add(out.new_token_ids)
        if out.finished:
            text += self._detokenizer.flush()
        if self._awaiting is not None:
            self._awaiting.add(out.logprobs or (), text)
        sent = text if out.num_output_tokens <= self._min_tokens else self._matcher.feed(text)
        self._num_sent += len(sent)
        return sent

    def _release(self, num_chars: int) -> tuple[SentToken, ...]:
        """The tokens whose text is within the first ``num_chars`` characters sent (none without logprobs)."""
        return () if self._awaiting is None else self._awaiting.release(num_chars)

    def _delta(self, text: str, reason: str | None, tokens: tuple[SentToken, ...]) -> TextDelta:
        """A delta with the current counts; the prompt logprobs go with the first one only."""
        delta = TextDelta(text, reason, self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens,
                          tokens, self._prompt_logprobs, tuple(self._new_ids))
        self._prompt_logprobs = None
        self._new_ids.clear()
        return delta

