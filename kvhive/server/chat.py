"""``POST /v1/chat/completions``: messages rendered with the model's chat template, one reply."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from kvhive.server.errors import bad_request
from kvhive.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
)
from kvhive.server.serving import (
    SSE_DONE,
    GenerationService,
    new_request_id,
    sse_event,
    unix_time,
)


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.logprobs:
        raise bad_request("'logprobs' is not supported", param="logprobs")
    if body.top_logprobs is not None:
        raise bad_request("'top_logprobs' is not supported", param="top_logprobs")
    if body.tools:
        raise bad_request("'tools' are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("Only response_format {\"type\": \"text\"} is supported", param="response_format")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: string content; ``developer`` is a system message."""
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    rendered: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if message.content is None or isinstance(message.content, str):
            content = message.content or ""
        else:
            texts = []
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Only text content parts are supported, got type '{part.type}'",
                                      param=f"messages[{i}].content[{j}].type")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


async def create_chat_completion(service: GenerationService, body: ChatCompletionRequest,
                                 raw_request: Request, new_session_ttl: int | None = None
                                 ) -> Response | ChatCompletionResponse:
    """Validate, run and answer one chat completion request (in a session: ``x-session-id`` or
    ``conversation_id``, or a new one with ``new_session_ttl``; the answer carries ``x-session-id``)."""
    service.check_common(body)
    _check_unsupported(body)
    messages = template_messages(body.messages)
    try:
        token_ids = service.tokenizer.encode_chat(messages)
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from exc
    requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
    max_tokens = service.resolve_max_tokens(requested, len(token_ids), param, "messages")
    sampling = service.sampling_params(body, max_tokens)
    owner = service.owner_of(raw_request)
    session = service.open_session(raw_request, body.model, len(token_ids) + max_tokens,
                                   conversation_id=body.conversation_id, new_ttl=new_session_ttl)
    headers = {} if session is None else {"x-session-id": session.session_id}
    request_id = new_request_id("chatcmpl")
    created = unix_time()
    model = service.served_model_name
    deltas = service.stream(request_id, token_ids, sampling, body.stop_strings,
                            service.cache_salt_for(owner, body.cache_salt), session=session,
                            end_session=body.end_conversation)

    if not body.stream:
        result = await service.collect(deltas, raw_request)
        if result is None:
            return Response(status_code=499)          # the client is gone; nobody reads this
        choice = ChatChoice(message=AssistantMessage(content=result.text),
                            finish_reason=result.finish_reason)
        answer = ChatCompletionResponse(id=request_id, created=created, model=model, choices=[choice],
                                        usage=result.usage())
        return JSONResponse(answer.model_dump(mode="json"), headers=headers) if headers else answer

    include_usage = body.include_usage
    exclude = None if include_usage else {"usage"}

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]),
                         exclude=exclude)

    async def events() -> AsyncIterator[str]:
        yield chunk(DeltaMessage(role="assistant", content=""))
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                if delta.text:
                    yield chunk(DeltaMessage(content=delta.text))
                if delta.finish_reason is None:
                    continue
                yield chunk(DeltaMessage(), delta.finish_reason)
                if include_usage:
                    yield sse_event(ChatCompletionChunk(id=request_id, created=created, model=model,
                                                        choices=[], usage=delta.usage()))
        yield SSE_DONE

    return service.sse_response(events(), headers, session, end_session=body.end_conversation)
