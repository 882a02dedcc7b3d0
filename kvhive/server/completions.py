"""``POST /v1/completions``: one prompt (text or token ids), or a list of them (OpenAI's batch form),
in; ``n`` texts out per prompt (one by default), streamed or whole, with the logprobs of their tokens
when asked and the prompt first with ``echo``; vLLM's ``prompt_logprobs`` and ``return_token_ids``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import Response

from kvhive.engine.step import TokenLogprobs
from kvhive.request import MAX_LOGPROBS
from kvhive.server.choices import choice_streams, merge_streams, whole_answer
from kvhive.server.completion_prompts import PromptInput, check_batch, prompt_input, request_prompts
from kvhive.server.errors import bad_request
from kvhive.server.generation import GenerationService
from kvhive.server.logprobs import (
    SentToken,
    completion_logprobs,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
)
from kvhive.server.prompt_cache import PromptCache, client_retention
from kvhive.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from kvhive.server.request_checks import check_prompt_logprobs
from kvhive.server.response_identity import new_request_id, unix_time
from kvhive.server.session_turns import open_session, session_headers, sse_response_ending_turns
from kvhive.server.sse import SSE_DONE, sse_event
from kvhive.server.structured import body_structured_spec
from kvhive.server.text_deltas import TextDelta, TextOptions, combined_usage


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
    if body.truncate_prompt_tokens is not None and body.echo:
        raise bad_request("'truncate_prompt_tokens' cannot be used with 'echo' (the echo is the prompt as sent)",
                          param="truncate_prompt_tokens")


def echo_logprobs_wanted(body: CompletionRequest) -> int | None:
    """Top alternatives per prompt token in the echo's logprobs: with echo and logprobs, the prompt's
    tokens get logprobs too, ahead of the generated ones (None: no echoed logprobs)."""
    return body.logprobs if body.echo else None


def engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """Top alternatives the engine computes per prompt token: the most that the echo's logprobs and
    vLLM's ``prompt_logprobs`` ask for (None: no prompt logprobs)."""
    asked = [n for n in (echo_logprobs_wanted(body), body.prompt_logprobs) if n is not None]
    return max(asked) if asked else None


def scores_prompt_only(body: CompletionRequest) -> bool:
    """max_tokens 0 with echo scores the prompt: the engine samples one token (it always does),
    which is dropped (vLLM does the same)."""
    return body.echo and body.max_tokens == 0


def check_outside_session(raw_request: Request, new_session_ttl: int | None, param: str) -> None:
    """400 when a request asking for prompt logprobs (echo with logprobs, or ``prompt_logprobs``)
    would run in a session (``x-session-id``, or a new one from ``POST /v1/context``)."""
    if raw_request.headers.get("x-session-id") or new_session_ttl is not None:
        raise bad_request("Prompt logprobs ('echo' with 'logprobs', or 'prompt_logprobs') cannot run in a "
                          "session: they need every prompt token computed, and a session reuses its "
                          "tokens' KV", param=param)


@dataclass(frozen=True)
class CompletionAnswer:
    """What one completion request answers, whole or streamed: ``n`` choices per prompt (choice
    ``p * n + j`` is prompt p's j-th), each after its echoed prompt, with their logprobs (and the
    prompt's) when asked, the sampled token dropped when scoring."""

    service: GenerationService
    body: CompletionRequest
    prompts: list[PromptInput]
    request_id: str = field(default_factory=lambda: new_request_id("cmpl"))
    created: int = field(default_factory=unix_time)

    def prompt_of(self, index: int) -> PromptInput:
        """The prompt of choice ``index``."""
        return self.prompts[index // self.body.n]

    def choice(self, index: int, text: str, finish_reason: str | None, tokens: tuple[SentToken, ...],
               prompt_values: tuple[TokenLogprobs, ...] | None = None, token_ids: tuple[int, ...] | None = None,
               with_prompt_ids: bool = False) -> CompletionChoice:
        """One choice; with logprobs asked, its tokens' (offset past the echo) and the echoed
        prompt's (from ``prompt_values``); vLLM's ``prompt_logprobs`` from ``prompt_values`` when
        asked; with ``return_token_ids``, ``token_ids`` and (``with_prompt_ids``) the prompt's ids."""
        body, prompt, tokenizer = self.body, self.prompt_of(index), self.service.tokenizer
        logprobs = None
        if body.logprobs is not None:
            echoed = None
            if prompt_values is not None and echo_logprobs_wanted(body) is not None:
                echoed = prompt_completion_logprobs(prompt.token_ids, top_of(prompt_values, body.logprobs),
                                                    tokenizer, prompt.text_start)
            logprobs = completion_logprobs(tokens, tokenizer, len(prompt.echo), echoed)
        scored = None
        if prompt_values is not None and body.prompt_logprobs is not None:
            scored = vllm_prompt_logprobs(prompt_values, tokenizer, body.prompt_logprobs)
        ids = list(token_ids) if body.return_token_ids and token_ids is not None else None
        prompt_ids = prompt.token_ids if body.return_token_ids and with_prompt_ids else None
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                token_ids=ids, prompt_token_ids=prompt_ids, prompt_logprobs=scored)

    def shown(self, delta: TextDelta) -> TextDelta:
        """The delta as the client sees it: with max_tokens 0, the sampled token is dropped."""
        if not scores_prompt_only(self.body):
            return delta
        return replace(delta, text="", tokens=(), token_ids=(), num_output_tokens=0,
                       finish_reason=None if delta.finish_reason is None else "length")

    def usage(self, finals: list[TextDelta]) -> Usage:
        """The usage of the choices' last deltas (in index order): each prompt counted once."""
        n = self.body.n
        return summed_usage([combined_usage(finals[p * n:(p + 1) * n]) for p in range(len(self.prompts))])

    def response(self, results: list[TextDelta]) -> CompletionResponse:
        """The non-streamed answer: each choice's whole text after its echo, and the usage."""
        results = [self.shown(r) for r in results]
        choices = [self.choice(i, self.prompt_of(i).echo + r.text, r.finish_reason, r.tokens, r.prompt_logprobs,
                               r.token_ids, with_prompt_ids=True)
                   for i, r in enumerate(results)]
        return CompletionResponse(id=self.request_id, created=self.created, model=self.service.served_model_name,
                                  usage=self.usage(results), choices=choices)

    def chunk(self, *choices: CompletionChoice, usage: Usage | None = None) -> str:
        """One SSE event of the stream (its ``usage`` field only when the request asked for usage)."""
        return sse_event(CompletionResponse(id=self.request_id, created=self.created,
                                            model=self.service.served_model_name, choices=list(choices),
                                            usage=usage), exclude=None if self.body.include_usage else {"usage"})

    def running_usage(self, delta: TextDelta | None, index: int) -> Usage | None:
        """The usage on a choice's chunk with ``continuous_usage_stats``: its prompt's tokens and
        the choice's so far (None otherwise, and before the engine has counted anything)."""
        if not self.body.continuous_usage:
            return None
        if delta is None:
            prompt = len(self.prompt_of(index).token_ids)
            return Usage(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt,
                         prompt_tokens_details=PromptTokensDetails())
        return delta.usage()

    async def events(self, streams: list[AsyncIterator[TextDelta]]) -> AsyncIterator[str]:
        """The SSE events: the echo of each choice, each choice's deltas as they come, the usage
        when asked, then [DONE]. A choice's first chunk carries its prompt's ids (``return_token_ids``)."""
        body = self.body
        started: set[int] = set()
        if echo_logprobs_wanted(body) is None:
            for index in range(len(streams)):
                if self.prompt_of(index).echo:
                    started.add(index)
                    yield self.chunk(self.choice(index, self.prompt_of(index).echo, None, (), token_ids=(),
                                                 with_prompt_ids=True), usage=self.running_usage(None, index))
        finals: dict[int, TextDelta] = {}
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for index, delta in merged:
                delta = self.shown(delta)
                if delta.prompt_logprobs is not None:
                    # The echo waited for its logprobs, which come with the choice's first delta.
                    started.add(index)
                    yield self.chunk(self.choice(index, self.prompt_of(index).echo, None, (), delta.prompt_logprobs,
                                                 token_ids=(), with_prompt_ids=True),
                                     usage=self.running_usage(None, index))
                if scores_prompt_only(body) and delta.finish_reason is None:
                    continue
                first = index not in started
                started.add(index)
                yield self.chunk(self.choice(index, delta.text, delta.finish_reason, delta.tokens,
                                             token_ids=delta.token_ids, with_prompt_ids=first),
                                 usage=self.running_usage(delta, index))
                if delta.finish_reason is not None:
                    finals[index] = delta
        if body.include_usage:
            yield self.chunk(usage=self.usage([finals[i] for i in range(len(streams))]))
        yield SSE_DONE


def summed_usage(usages: list[Usage]) -> Usage:
    """The usage of several prompts' choices: every count summed."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def top_of(values: tuple[TokenLogprobs, ...], num_top: int) -> tuple[TokenLogprobs, ...]:
    """``values`` with at most ``num_top`` alternatives each (the engine computed the most any
    field asked for)."""
    return tuple(replace(v, top=v.top[:num_top]) for v in values)


async def create_completion(service: GenerationService, body: CompletionRequest,
                            raw_request: Request, new_session_ttl: int | None = None
                            ) -> Response | CompletionResponse:
    """Validate, run and answer one completion request: one prompt or several (OpenAI's batch form,
    never in a session), ``n`` choices each. In a session (``x-session-id``, or a new one with
    ``new_session_ttl``) the answer carries ``x-session-id``."""
    service.check_common(body)
    _check_unsupported(body)
    check_prompt_logprobs(body)
    kv_transfer = service.kv_transfer_params(body)
    texts = request_prompts(body.prompt)
    check_batch(body, len(texts), raw_request, new_session_ttl)
    if kv_transfer is not None and len(texts) != 1:
        raise bad_request("kv_transfer_params needs one prompt", param="prompt")
    prompt_logprobs = engine_prompt_logprobs(body)
    structured = await body_structured_spec(service.engine, body)
    service.check_transfer_unconstrained(structured, kv_transfer)
    if prompt_logprobs is not None:
        check_outside_session(raw_request, new_session_ttl,
                              "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs")
    prompts = [await prompt_input(service, body, text, echo_logprobs_wanted(body) is not None) for text in texts]
    asked = 1 if scores_prompt_only(body) else body.max_tokens
    limits = [service.resolve_max_tokens(asked, len(p.token_ids), "max_tokens", "prompt") for p in prompts]
    owner = service.owner_of(raw_request)
    max_ttl_s = service.sessions.config.max_ttl_s
    retentions = [PromptCache(client_retention(body.kv_cache_retention_config, len(p.token_ids), max_ttl_s))
                  for p in prompts]
    turn = await open_session(service, raw_request, body.model, len(prompts[0].token_ids) + limits[0],
                              new_ttl=new_session_ttl, n=body.n, turn_number=body.turn_number)
    answer = CompletionAnswer(service, body, prompts)
    salt = service.cache_salt_for(owner, body.cache_salt)
    streams = []
    for p, (prompt, max_tokens) in enumerate(zip(prompts, limits, strict=True)):
        sampling = service.sampling_params(body, max_tokens, body.logprobs, prompt_logprobs, structured)
        request_id = answer.request_id if len(prompts) == 1 else f"{answer.request_id}-p{p}"
        streams += choice_streams(service, request_id, body.n, prompt.token_ids, sampling, body.stop_strings,
                                  salt, turn, kv_transfer, TextOptions.of(body), retentions[p],
                                  priority=body.priority)
    headers = session_headers(turn)
    if not body.stream:
        return await whole_answer(streams, raw_request, headers,
                                  service.with_kv_transfer(answer.response, kv_transfer))
    return sse_response_ending_turns(answer.events(streams), headers, turn)
