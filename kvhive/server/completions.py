"""``POST /v1/completions``: one prompt (text or token ids) in, text out, streamed or whole."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvhive.server.errors import bad_request
from kvhive.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvhive.server.serving import (
    SSE_DONE,
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
                            raw_request: Request, new_session_ttl: int | None = None
                            ) -> Response | CompletionResponse:
    """Validate, run and answer one completion request (in a session: ``x-session-id``, or a new
    one with ``new_session_ttl``; the answer then carries ``x-session-id``)."""
    service.check_common(body)
    _check_unsupported(body)
    token_ids = prompt_token_ids(service, body.prompt)
    max_tokens = service.resolve_max_tokens(body.max_tokens, len(token_ids), "max_tokens", "prompt")
    sampling = service.sampling_params(body, max_tokens)
    owner = service.owner_of(raw_request)
    session = service.open_session(raw_request, body.model, len(token_ids) + max_tokens,
                                   new_ttl=new_session_ttl)
    headers = {} if session is None else {"x-session-id": session.session_id}
    request_id = new_request_id("cmpl")
    created = unix_time()
    deltas = service.stream(request_id, token_ids, sampling, body.stop_strings,
                            service.cache_salt_for(owner, body.cache_salt), session=session)

    def response(delta: TextDelta, final: bool) -> CompletionResponse:
        choice = CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)
        return CompletionResponse(id=request_id, created=created, model=service.served_model_name,
                                  choices=[choice],
                                  usage=delta.usage() if final else None)

    if not body.stream:
        result = await service.collect(deltas, raw_request)
        if result is None:
            return Response(status_code=499)          # the client is gone; nobody reads this
        if headers:
            return JSONResponse(response(result, final=True).model_dump(mode="json"), headers=headers)
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

    return service.sse_response(events(), headers, session)
