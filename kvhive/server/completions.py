"""``POST /v1/completions``: one prompt (text or token ids) in, text out, streamed or whole."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvhive.server.errors import bad_request
from kvhive.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvhive.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    GenerationService,
    TextDelta,
    new_request_id,
    sse_event,
    unix_time,
)


def _check_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise bad_request("'echo' is not supported", param="echo")
    if body.logprobs is not None:
        raise bad_request("'logprobs' is not supported", param="logprobs")
    if body.best_of is not None and body.best_of != 1:
        raise bad_request("Only best_of=1 is supported", param="best_of")
    if body.suffix:
        raise bad_request("'suffix' is not supported", param="suffix")


def prompt_token_ids(service: GenerationService, prompt: str | list[int] | list[str] | list[list[int]]
                     ) -> list[int]:
    """The one prompt of the request as token ids (a list holding one prompt is unwrapped)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(f"Several prompts in one request are not supported (got {len(prompt)}); "
                              f"send one request per prompt", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        token_ids = service.tokenizer.encode(prompt)
    else:
        token_ids = list(prompt)
        service.check_token_ids(token_ids, "prompt")
    if not token_ids:
        raise bad_request("The prompt is empty", param="prompt")
    return token_ids


async def create_completion(service: GenerationService, body: CompletionRequest,
                            raw_request: Request) -> Response | CompletionResponse:
    """Validate, run and answer one completion request."""
    service.check_common(body)
    _check_unsupported(body)
    token_ids = prompt_token_ids(service, body.prompt)
    max_tokens = service.resolve_max_tokens(body.max_tokens, len(token_ids), "max_tokens", "prompt")
    sampling = service.sampling_params(body, max_tokens)
    request_id = new_request_id("cmpl")
    created = unix_time()
    deltas = service.stream(request_id, token_ids, sampling, body.stop_strings, body.cache_salt)

    def response(delta: TextDelta, final: bool) -> CompletionResponse:
        choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return CompletionResponse(id=request_id, created=created, model=service.served_model_name,
                                  choices=[choice],
                                  usage=delta.usage() if final else None)

    if not body.stream:
        result = await service.collect(deltas, raw_request)
        if result is None:
            return Response(status_code=499)          # the client is gone; nobody reads this
        return response(result, final=True)

    include_usage = body.include_usage
    exclude = None if include_usage else {"usage"}

    async def events() -> AsyncIterator[str]:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield sse_event(response(delta, final=False), exclude=exclude)
                if delta.finish_reason is not None and include_usage:
                    usage_chunk = CompletionResponse(id=request_id, created=created, choices=[],
                                                     model=service.served_model_name, usage=delta.usage())
                    yield sse_event(usage_chunk)
        yield SSE_DONE

    return StreamingResponse(service.sse_with_errors(events()), media_type="text/event-stream",
                             headers=SSE_HEADERS)
