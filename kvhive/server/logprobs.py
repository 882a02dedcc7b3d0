"""Logprobs as the API shows them: which tokens go out with which text, and their JSON shapes.

A token's logprobs go out in the chunk that carries the start of its text. Text can lag its token:
the detokenizer holds back a partial UTF-8 character until the token that completes it, and the
stop matcher holds back what could start a stop string. ``TokensAwaitingText`` keeps each token
with the span of generated text it produced and lets it go once part of that span has been sent.
With ``echo``, a completion's logprobs start with the prompt's tokens (``prompt_completion_logprobs``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhive.core.tokenizer import IncrementalDetokenizer
from kvhive.engine.step import TokenLogprobs
from kvhive.server.chat_protocol import ChatLogprobs, ChatTokenLogprob, TopLogprob
from kvhive.server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer


@dataclass(frozen=True)
class SentToken:
    """A generated token whose text (or part of it) went out, with where that text starts."""

    logprobs: TokenLogprobs
    text_offset: int          # in the choice's generated text, in characters


class TokensAwaitingText:
    """Generated tokens waiting for their text to be sent, oldest first.

    Invariant: the waiting tokens' text spans [start, end) of the generated text (before stop
    strings) follow each other: one's ``start`` is the ``end`` of the one before.
    """

    def __init__(self) -> None:
        self._waiting: deque[tuple[TokenLogprobs, int]] = deque()    # (logprobs, start)
        self._text_len = 0

    def add(self, logprobs: Sequence[TokenLogprobs], text: str) -> None:
        """Record the tokens of one engine output and the text the detokenizer gave for them.

        Tokens of one output share its text span (the engine gives one token per output).
        """
        for token in logprobs:
            self._waiting.append((token, self._text_len))
        self._text_len += len(text)

    def release(self, num_sent: int) -> tuple[SentToken, ...]:
        """The waiting tokens whose text starts within the first ``num_sent`` characters sent.

        A token split by what is held back goes with the part sent first; a token without text of
        its own (the first bytes of a character, a skipped special token) waits for the next text,
        which is where its character appears. After a stop string, the tokens still waiting are
        the ones none of whose text went out: they are never sent.
        """
        out = []
        while self._waiting and self._waiting[0][1] < num_sent:
            token, start = self._waiting.popleft()
            out.append(SentToken(token, start))
        return tuple(out)

    def release_all(self) -> tuple[SentToken, ...]:
        """Every waiting token: generation ended without a stop string, so all their text went out
        (tokens without text at the end, such as the end-of-turn token, included)."""
        out = tuple(SentToken(token, start) for token, start in self._waiting)
        self._waiting.clear()
        return out


def token_string(data: bytes) -> str:
    """A token's text; a token that is not whole UTF-8 (part of a character) as ``bytes:\\xe6\\x97``
    (OpenAI's and vLLM's convention), its raw bytes still in the ``bytes`` field."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_logprobs(tokens: Sequence[SentToken], tokenizer: Tokenizer) -> ChatLogprobs:
    """The chat shape: per token its string, logprob, bytes and the top alternatives."""

    def described(token_id: int, logprob: float) -> dict[str, Any]:
        data = tokenizer.token_bytes(token_id)
        return {"token": token_string(data), "logprob": logprob, "bytes": list(data)}

    content = [ChatTokenLogprob(**described(s.logprobs.token_id, s.logprobs.logprob),
                                top_logprobs=[TopLogprob(**described(t, v)) for t, v in s.logprobs.top])
               for s in tokens]
    return ChatLogprobs(content=content)


def completion_logprobs(tokens: Sequence[SentToken], tokenizer: Tokenizer, text_offset: int = 0,
                        prompt: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists; each top dict holds the top tokens and the
    chosen one (up to N + 1 entries, as OpenAI documents). Tokens with the same string share a key;
    the more likely one's value is kept. ``text_offset`` (the echoed prompt's length) is added to
    the tokens' offsets; ``prompt`` (the echoed prompt's logprobs) comes first."""
    out = (CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
           if prompt is None else prompt.model_copy(deep=True))
    for sent in tokens:
        _append_token(out, sent.logprobs, text_offset + sent.text_offset, tokenizer)
    return out


def prompt_completion_logprobs(prompt_ids: Sequence[int], values: Sequence[TokenLogprobs],
                               tokenizer: Tokenizer, text_start: int = 0) -> CompletionLogprobs:
    """The echoed prompt's logprobs in the completions shape: the first token with null entries
    (nothing comes before it), then ``values`` (token i given the tokens before it, i >= 1); text
    offsets into the prompt decoded with its special tokens (the echoed text). The first
    ``text_start`` tokens were added before the text sent (a BOS): they are at offset 0 and the
    text is the rest decoded."""
    if len(values) != len(prompt_ids) - 1:
        raise ValueError(f"{len(values)} prompt logprobs for a prompt of {len(prompt_ids)} tokens")
    offsets = [0] * text_start + _prompt_token_offsets(prompt_ids[text_start:], tokenizer)
    out = CompletionLogprobs(tokens=[token_string(tokenizer.token_bytes(prompt_ids[0]))],
                             token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    for lp, offset in zip(values, offsets[1:], strict=True):
        _append_token(out, lp, offset, tokenizer)
    return out


def _prompt_token_offsets(prompt_ids: Sequence[int], tokenizer: Tokenizer) -> list[int]:
    """Where each prompt token's text starts in the decoded prompt; a token without text of its
    own (the first bytes of a character) starts where its character does."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    offsets, length = [], 0
    for token_id in prompt_ids:
        offsets.append(length)
        length += len(detokenizer.add([token_id]))
    return offsets


def _append_token(out: CompletionLogprobs, lp: TokenLogprobs, text_offset: int, tokenizer: Tokenizer) -> None:
    chosen = token_string(tokenizer.token_bytes(lp.token_id))
    top: dict[str, float] = {}
    for token_id, value in lp.top:
        top.setdefault(token_string(tokenizer.token_bytes(token_id)), value)
    top.setdefault(chosen, lp.logprob)
    out.tokens.append(chosen)
    out.token_logprobs.append(lp.logprob)
    out.top_logprobs.append(top)
    out.text_offset.append(text_offset)


def vllm_prompt_logprobs(values: Sequence[TokenLogprobs], tokenizer: Tokenizer, num_top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: null for the first prompt token (nothing comes before it), then per
    token (``values``: token i given the tokens before it) the prompt's own token and the ``num_top``
    most likely, by token id, each with its logprob, rank and text. The prompt's own token comes
    first; its rank is null when it is not among the top ranks the engine reports."""
    out: PromptLogprobs = [None]
    for lp in values:
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(lp.top, start=1)}
        entries = [(lp.token_id, lp.logprob), *[(t, v) for t, v in lp.top[:num_top] if t != lp.token_id]]
        out.append({str(token_id): PromptLogprob(logprob=value, rank=ranks.get(token_id),
                                                 decoded_token=token_string(tokenizer.token_bytes(token_id)))
                    for token_id, value in entries})
    return out
