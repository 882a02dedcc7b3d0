"""``POST /v1/completions``: one prompt (text or token ids) in, ``n`` texts out (one by default),
streamed or whole, with the logprobs of their tokens when asked and the prompt first with ``echo``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import Response

from kvhive.core.tokenizer import Tokenizer
from kvhive.engine.step import TokenLogprobs
from kvhive.request import MAX_LOGPROBS
from kvhive.server.errors import bad_request
from kvhive.server.logprobs import SentToken, completion_logprobs, prompt_completion_logprobs
from kvhive.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from kvhive.server.serving import (
    OFF_LOOP_CHARS,
    GenerationService,
    TextDelta,
    combined_usage,
    merge_streams,
    new_request_id,
    session_headers,
    unix_time,
)
from kvhive.server.sse import SSE_DONE, sse_event
from kvhive.server.structured import body_structured_spec


def _check_unsupported(body: CompletionRequest) -> None:
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}",
                          param="logprobs")
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("'max_tokens' must be at least 1 (0 only with 'echo', to score the prompt)",
                          param="max_tokens")
    if body.best_of is not None and body.best_of != 1:
        raise bad_request("Only best_of=1 is supported", param="best_of")
    if body.best_of is not None and body.n > 1:
        raise bad_request(f"'best_of' must be at least 'n' ({body.n}); leave it unset", param="best_of")
    if body.suffix:
        raise bad_request("'suffix' is not supported", param="suffix")


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of the request, text or token ids (a list holding one prompt is unwrapped)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"Several prompts in one request are not supported (got {len(prompt)}); "
                              f"send one request per prompt", param="prompt")
        return prompt[0]
    return prompt


def prompt_token_ids(service: GenerationService, prompt: str | list[int] | list[str] | list[list[int]],
                     add_special_tokens: bool = True) -> list[int]:
    """The one prompt of the request as token ids (tokenized on the calling thread): a text with the
    BOS/EOS the model's tokenizer asks for unless ``add_special_tokens`` is false, token ids as given."""
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        token_ids = service.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        token_ids = list(prompt)
        service.check_token_ids(token_ids, "prompt")
    if not token_ids:
        raise bad_request("The prompt is empty", param="prompt")
    return token_ids


async def prompt_token_ids_off_loop(service: GenerationService,
                                    prompt: str | list[int] | list[str] | list[list[int]],
                                    add_special_tokens: bool = True) -> list[int]:
    """``prompt_token_ids``, on a worker thread for a text (or token-id list) of OFF_LOOP_CHARS
    characters (ids) or more: the event loop goes on serving meanwhile."""
    one = single_prompt(prompt)
    if len(one) >= OFF_LOOP_CHARS:
        return await asyncio.to_thread(prompt_token_ids, service, one, add_special_tokens)
    return prompt_token_ids(service, one, add_special_tokens)


def text_start(tokenizer: Tokenizer, text: str, token_ids: list[int]) -> int:
    """How many leading ids of ``text``'s encoding with special tokens (``token_ids``) the tokenizer
    added before the text itself (its BOS): the ids of the text alone follow them."""
    plain = tokenizer.encode(text)
    for start in range(len(token_ids) - len(plain) + 1):
        if token_ids[start:start + len(plain)] == plain:
            return start
    return 0


async def echo_text_start(service: GenerationService, body: CompletionRequest, token_ids: list[int]) -> int:
    """``text_start`` of a text prompt encoded with special tokens (0 for token ids, or without
    them): the echoed text begins at the token after the ones added (off the loop when long)."""
    prompt = single_prompt(body.prompt)
    if not isinstance(prompt, str) or not body.add_special_tokens:
        return 0
    if len(prompt) >= OFF_LOOP_CHARS:
        return await asyncio.to_thread(text_start, service.tokenizer, prompt, token_ids)
    return text_start(service.tokenizer, prompt, token_ids)


def echoed_prompt(service: GenerationService, prompt: str | list[int]) -> str:
    """The prompt text ``echo`` puts before the completion: as sent, or token ids decoded (special
    tokens included: they are part of what was sent)."""
    return prompt if isinstance(prompt, str) else service.tokenizer.decode(prompt, skip_special_tokens=False)


def prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """Top alternatives per prompt token: with echo and logprobs, the prompt's tokens get logprobs
    too, ahead of the generated ones (None: no prompt logprobs)."""
    return body.logprobs if body.echo else None


def scores_prompt_only(body: CompletionRequest) -> bool:
    """max_tokens 0 with echo scores the prompt: the engine samples one token (it always does),
    which is dropped (vLLM does the same)."""
    return body.echo and body.max_tokens == 0


def check_outside_session(raw_request: Request, new_session_ttl: int | None) -> None:
    """400 when a request asking for prompt logprobs (echo with logprobs) would run in a session
    (``x-session-id``, or a new one from ``POST /v1/context``)."""
    if raw_request.headers.get("x-session-id") or new_session_ttl is not None:
        raise bad_request("'echo' with 'logprobs' cannot run in a session: the prompt logprobs need "
                          "every prompt token computed, and a session reuses its tokens' KV", param="logprobs")


@dataclass(frozen=True)
class CompletionAnswer:
    """What one completion request answers, whole or streamed: its choices after the echoed prompt,
    with their logprobs (and the prompt's) when asked, the sampled token dropped when scoring."""

    service: GenerationService
    body: CompletionRequest
    token_ids: list[int]
    echo: str                                    # the prompt text before each choice; "" without echo
    text_start: int = 0                          # leading prompt ids added before the text (a BOS)
    request_id: str = field(default_factory=lambda: new_request_id("cmpl"))
    created: int = field(default_factory=unix_time)

    def choice(self, index: int, text: str, finish_reason: str | None, tokens: tuple[SentToken, ...],
               prompt_values: tuple[TokenLogprobs, ...] | None = None) -> CompletionChoice:
        """One choice; with logprobs asked, its tokens' (offset past the echo) and the prompt's
        (``prompt_values``, on the echo's choice)."""
        logprobs = None
        if self.body.logprobs is not None:
            tokenizer = self.service.tokenizer
            prompt = (None if prompt_values is None
                      else prompt_completion_logprobs(self.token_ids, prompt_values, tokenizer,
                                                      self.text_start))
            logprobs = completion_logprobs(tokens, tokenizer, len(self.echo), prompt)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    def shown(self, delta: TextDelta) -> TextDelta:
        """The delta as the client sees it: with max_tokens 0, the sampled token is dropped."""
        if not scores_prompt_only(self.body):
            return delta
        return replace(delta, text="", tokens=(), num_output_tokens=0,
                       finish_reason=None if delta.finish_reason is None else "length")

    def response(self, results: list[TextDelta]) -> CompletionResponse:
        """The non-streamed answer: each choice's whole text after the echo, and the usage."""
        results = [self.shown(r) for r in results]
        choices = [self.choice(i, self.echo + r.text, r.finish_reason, r.tokens, r.prompt_logprobs)
                   for i, r in enumerate(results)]
        return CompletionResponse(id=self.request_id, created=self.created, model=self.service.served_model_name,
                                  usage=combined_usage(results), choices=choices)

    def chunk(self, *choices: CompletionChoice, usage: Usage | None = None) -> str:
        """One SSE event of the stream (its ``usage`` field only when the request asked for usage)."""
        return sse_event(CompletionResponse(id=self.request_id, created=self.created,
                                            model=self.service.served_model_name, choices=list(choices),
                                            usage=usage), exclude=None if self.body.include_usage else {"usage"})

    async def events(self, streams: list[AsyncIterator[TextDelta]]) -> AsyncIterator[str]:
        """The SSE events: the echo of each choice, each choice's deltas as they come, the usage
        when asked, then [DONE]."""
        body = self.body
        if self.echo and prompt_logprobs_wanted(body) is None:
            for index in range(body.n):
                yield self.chunk(CompletionChoice(index=index, text=self.echo))
        finals: dict[int, TextDelta] = {}
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for index, delta in merged:
                delta = self.shown(delta)
                if delta.prompt_logprobs is not None:
                    # The echo waited for its logprobs, which come with the choice's first delta.
                    yield self.chunk(self.choice(index, self.echo, None, (), delta.prompt_logprobs))
                if scores_prompt_only(body) and delta.finish_reason is None:
                    continue
                yield self.chunk(self.choice(index, delta.text, delta.finish_reason, delta.tokens))
                if delta.finish_reason is not None:
                    finals[index] = delta
        if body.include_usage:
            yield self.chunk(usage=combined_usage([finals[i] for i in range(body.n)]))
        yield SSE_DONE


async def create_completion(service: GenerationService, body: CompletionRequest,
                            raw_request: Request, new_session_ttl: int | None = None
                            ) -> Response | CompletionResponse:
    """Validate, run and answer one completion request (in a session: ``x-session-id``, or a new
    one with ``new_session_ttl``; the answer then carries ``x-session-id``)."""
    service.check_common(body)
    _check_unsupported(body)
    kv_transfer = service.kv_transfer_params(body)
    token_ids = await prompt_token_ids_off_loop(service, body.prompt, body.add_special_tokens)
    echo = echoed_prompt(service, single_prompt(body.prompt)) if body.echo else ""
    prompt_logprobs = prompt_logprobs_wanted(body)
    max_tokens = service.resolve_max_tokens(1 if scores_prompt_only(body) else body.max_tokens, len(token_ids),
                                            "max_tokens", "prompt")
    structured = await body_structured_spec(service.engine, body)
    sampling = service.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs, structured)
    if prompt_logprobs is not None:
        check_outside_session(raw_request, new_session_ttl)
    owner = service.owner_of(raw_request)
    turn = await service.open_session(raw_request, body.model, len(token_ids) + max_tokens,
                                      new_ttl=new_session_ttl, n=body.n)
    headers = session_headers(turn)
    start = 0 if prompt_logprobs is None else await echo_text_start(service, body, token_ids)
    answer = CompletionAnswer(service, body, token_ids, echo, text_start=start)
    streams = service.choice_streams(answer.request_id, body.n, token_ids, sampling, body.stop_strings,
                                     service.cache_salt_for(owner, body.cache_salt), turn, kv_transfer)
    if not body.stream:
        return await service.whole_answer(streams, raw_request, headers,
                                          service.with_kv_transfer(answer.response, kv_transfer))
    return service.sse_response(answer.events(streams), headers, turn)
