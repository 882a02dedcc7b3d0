"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the
chat path (docs/anthropic.md).

A body is checked (``messages_protocol``, then ``kvhive.core.anthropic_messages`` block by block),
rendered with the model's chat template as chat completions are, its ``cache_control``
breakpoints placed on the prompt's tokens and opened as pins (``kvhive.sessions.prefix_pins``,
owned by the API key, within its session budgets) before it runs. Tools go through the tool-calling
machinery (``ToolPlan``). Errors leave in Anthropic's shape (``messages_errors.AnthropicErrors``).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from kvhive.core.anthropic_breakpoints import breakpoint_chars, breakpoint_tokens
from kvhive.core.anthropic_messages import MessagesChat, messages_chat, render_body
from kvhive.core.json_body import BodyError
from kvhive.request import SamplingParams
from kvhive.server.choices import collect
from kvhive.server.errors import APIError, bad_request, body_error
from kvhive.server.generation import OFF_LOOP_CHARS, GenerationService
from kvhive.server.messages_errors import check_anthropic_headers
from kvhive.server.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesInput,
    MessagesRequest,
    MessagesResponse,
)
from kvhive.server.messages_stream import MessageAnswer
from kvhive.server.prompt_cache import client_retention, open_pins
from kvhive.server.request_body import parse_body
from kvhive.server.sampling_fields import pick
from kvhive.server.sse import SSE_HEADERS, ClosingStreamingResponse
from kvhive.server.text_deltas import TextOptions
from kvhive.server.tools import ToolPlan, chat_functions, tool_choice, tool_plan
from kvhive.sessions.prefix_pins import Breakpoint

BREAKPOINT_PARAM = "cache_control"


@dataclass(frozen=True)
class MessagesPrompt:
    """A body's prompt: its chat parts, token ids and each breakpoint as a pin request."""

    chat: MessagesChat
    token_ids: list[int]
    breakpoints: tuple[Breakpoint, ...]


# ``?beta=true``: what Anthropic's SDKs add to the URL of their beta client's calls; the betas
# themselves come in the anthropic-beta header (``check_anthropic_headers``).
_BETA_QUERY: dict[str, Any] = {"parameters": [
    {"name": "beta", "in": "query", "required": False, "schema": {"type": "string", "enum": ["true"]},
     "description": "sent by Anthropic's SDKs for their beta client; accepted, no effect"}]}


def check_beta_query(raw_request: Request) -> None:
    """400 unless ``beta``, if given, is given once as ``true``."""
    values = raw_request.query_params.getlist("beta")
    if values and values != ["true"]:
        raise bad_request(f"Query parameter 'beta' must be given once, as 'true' (got {values[:2]!r:.80})",
                          param="beta")


def install_messages_routes(app: FastAPI, service: GenerationService) -> None:
    """Add ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``."""

    @app.post("/v1/messages", response_model=None, openapi_extra=_BETA_QUERY)
    async def create_message(raw_request: Request) -> Response | MessagesResponse:
        """Anthropic's Messages API: one assistant message, streamed with SSE when ``stream`` is true."""
        check_beta_query(raw_request)
        check_anthropic_headers(raw_request.headers)
        body = await parse_body(raw_request, MessagesRequest)
        return await answer_message(service, body, raw_request)

    @app.post("/v1/messages/count_tokens", openapi_extra=_BETA_QUERY)
    async def count_tokens(raw_request: Request) -> CountTokensResponse:
        """The prompt tokens a Messages body would take (tools and system included)."""
        check_beta_query(raw_request)
        check_anthropic_headers(raw_request.headers)
        body = await parse_body(raw_request, CountTokensRequest)
        check_input(service, body)
        prompt = await messages_prompt(service, body, place_breakpoints=False)
        return CountTokensResponse(input_tokens=len(prompt.token_ids))


def check_input(service: GenerationService, body: MessagesInput) -> None:
    """404 for a model not served; 400 for extended thinking."""
    service.check_model(body.model)
    thinking = body.thinking
    if thinking is not None and (thinking.type != "disabled" or thinking.budget_tokens is not None):
        raise bad_request("Extended thinking is not served: send thinking {\"type\": \"disabled\"} or leave it out",
                          param="thinking.type")


def body_parts(body: MessagesInput) -> dict[str, Any]:
    """The parts ``kvhive.core.anthropic_messages`` reads, as the client sent them."""
    return {"system": body.system, "messages": body.messages, "tools": body.tools, "tool_choice": body.tool_choice,
            "cache_control": body.cache_control}


async def messages_prompt(service: GenerationService, body: MessagesInput, place_breakpoints: bool = True
                          ) -> MessagesPrompt:
    """The body rendered and tokenized, its breakpoints placed unless ``place_breakpoints`` is false
    (then it has none); off the event loop when long. 400 naming the field for a body the
    conversion or the template refuses."""
    parts = body_parts(body)
    try:
        chat = messages_chat(parts)
    except BodyError as exc:
        raise body_error(exc) from None
    if not place_breakpoints:
        chat = replace(chat, breakpoints=())
    size = sum(len(m.get("content") or "") for m in chat.messages) + len(str(chat.tools or ""))
    try:
        ids, counts = (_tokenized(service, parts, chat) if size < OFF_LOOP_CHARS
                       else await asyncio.to_thread(_tokenized, service, parts, chat))
    except BodyError as exc:
        raise body_error(exc) from None
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from exc
    breakpoints = tuple(Breakpoint(n, bp.ttl_s) for n, bp in zip(counts, chat.breakpoints, strict=True))
    return MessagesPrompt(chat, ids, breakpoints)


def _tokenized(service: GenerationService, parts: Mapping[str, Any], chat: MessagesChat) -> tuple[list[int], list[int]]:
    """The prompt's token ids and each breakpoint's token count (blocking: the render and the encodes)."""
    tokenizer = service.tokenizer
    text, offsets = breakpoint_chars(parts, chat.breakpoints, functools.partial(render_body, tokenizer))
    ids = tokenizer.encode(text)
    return ids, breakpoint_tokens(tokenizer.encode, text, ids, offsets)


async def messages_plan(service: GenerationService, chat: MessagesChat) -> ToolPlan:
    """The request's tool plan (``any`` and named choices decode under the calls' grammar); a
    refusal names the body's field (``tools[i].input_schema``)."""
    functions = chat_functions(chat.tools)
    try:
        return await tool_plan(service.engine, service.tokenizer.chat_template, service.tool_call_parser, functions,
                               tool_choice(chat.tool_choice, functions, flat=False), chat.parallel_tool_calls)
    except APIError as exc:
        if exc.param:
            exc.param = exc.param.replace(".function.parameters", ".input_schema")
            exc.message = exc.message.replace(".function.parameters", ".input_schema")
        raise


def messages_sampling(service: GenerationService, body: MessagesRequest, max_tokens: int, plan: ToolPlan
                      ) -> SamplingParams:
    """The engine's sampling parameters: unset fields from the model's defaults, else Anthropic's."""
    defaults = service.defaults
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    sampling = SamplingParams(max_tokens=max_tokens, temperature=pick(body.temperature, defaults.temperature, 1.0),
                              top_p=pick(body.top_p, defaults.top_p, 1.0), top_k=max(0, top_k or 0),
                              repetition_penalty=pick(None, defaults.repetition_penalty, 1.0),
                              min_p=pick(None, defaults.min_p, 0.0))
    return plan.with_spec(sampling)


async def answer_message(service: GenerationService, body: MessagesRequest, raw_request: Request
                         ) -> Response | MessagesResponse:
    """Validate, run and answer one Messages request. Nothing is pinned until every check passed."""
    check_input(service, body)
    prompt = await messages_prompt(service, body)
    plan = await messages_plan(service, prompt.chat)
    ids = prompt.token_ids
    max_tokens = service.resolve_max_tokens(body.max_tokens, len(ids), "max_tokens", "messages")
    sampling = messages_sampling(service, body, max_tokens, plan)
    retention = client_retention(body.kv_cache_retention_config, len(ids), service.sessions.config.max_ttl_s)
    stops = tuple(s for s in body.stop_sequences or () if s)
    salt = service.cache_salt_for(service.owner_of(raw_request), None)
    cache = await open_pins(service, raw_request, body.model, ids, prompt.breakpoints, salt, retention,
                            param=BREAKPOINT_PARAM)
    answer = MessageAnswer(service.served_model_name, plan, len(ids), stops, cache)
    stream = service.stream(answer.message_id, ids, sampling, stops, salt,
                            text=TextOptions(include_stop_str_in_output=True), cache=cache)
    if body.stream:
        return ClosingStreamingResponse(answer.events(stream), lambda: cache.end(None, 0),
                                        media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        result = await collect(stream, raw_request)
    finally:
        cache.end(None, 0)              # a no-op once the stream ended the pins' turn
    if result is None:
        return Response(status_code=499)          # the client is gone; nobody reads this
    return JSONResponse(answer.response(result).model_dump(mode="json"))
