"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes, ``kvhive.core.tokenize_bodies``).

The ids are the engine's: a prompt goes through ``service.tokenizer.encode`` and chat messages
(and ``tools``) through the same ``template_messages`` and chat template as ``/v1/chat/completions``. Long texts
and long id lists are worked off the event loop, as generation's are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from jinja2 import TemplateError

from kvhive.core.json_body import BodyError, ListOf
from kvhive.core.tokenize_bodies import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    chat_input,
    chat_token_ids,
    check_detokenize_request,
    check_tokenize_request,
    detokenize_response,
    prompt_token_ids,
    tokenize_model_for,
    tokenize_response,
)
from kvhive.server.chat import template_messages
from kvhive.server.chat_protocol import ChatMessage
from kvhive.server.errors import bad_request, body_error
from kvhive.server.generation import OFF_LOOP_CHARS, GenerationService
from kvhive.server.request_body import parse_body, parse_body_as

T = TypeVar("T")


class ChatTokenizeRequest(TokenizeChatRequest):
    """A chat ``/tokenize`` body whose messages are the chat completions' own model."""

    messages: ListOf[ChatMessage]   # type: ignore[assignment]


def _tokenize_model(data: dict[str, Any]) -> type[TokenizeCompletionRequest] | type[ChatTokenizeRequest]:
    """The body model of a parsed ``/tokenize`` object (``tokenize_model_for``, with the server's
    chat messages)."""
    return ChatTokenizeRequest if tokenize_model_for(data) is TokenizeChatRequest else TokenizeCompletionRequest


async def _off_loop_if(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, on a worker thread when ``size`` (characters, ids) reaches OFF_LOOP_CHARS."""
    if size >= OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def tokenize(service: GenerationService, raw_request: Request) -> TokenizeResponse:
    """The ids of a prompt or of chat messages, as the engine computes them."""
    try:
        body = await parse_body_as(raw_request, _tokenize_model)
        if body.model is not None:
            service.check_model(body.model)
        check_tokenize_request(body)
        if isinstance(body, ChatTokenizeRequest):
            ids = await _chat_ids(service, body)
        else:
            ids = await _off_loop_if(len(body.prompt), prompt_token_ids, service.tokenizer, body)
        return await _off_loop_if(len(ids) if body.return_token_strs else 0, tokenize_response,
                                  service.tokenizer, ids, service.max_model_len, body)
    except BodyError as exc:
        raise body_error(exc) from None


async def _chat_ids(service: GenerationService, body: ChatTokenizeRequest) -> list[int]:
    """The ids of the body's messages through the chat template, its tools and a history of tool
    calls and results rendered as chat completions render them (``chat_input``); 400 when the
    template fails."""
    messages, variables = chat_input(service.tokenizer, template_messages(body.messages), body)
    size = sum(len(m["content"]) for m in messages) + len(str(variables.get("tools") or ""))
    try:
        return await _off_loop_if(size, chat_token_ids, service.tokenizer, messages, body, variables)
    except BodyError:
        raise
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from exc


async def detokenize(service: GenerationService, raw_request: Request) -> DetokenizeResponse:
    """The text of token ids (special tokens written out)."""
    body = await parse_body(raw_request, DetokenizeRequest)
    if body.model is not None:
        service.check_model(body.model)
    try:
        check_detokenize_request(body, service.tokenizer.vocab_size, service.max_model_len)
    except BodyError as exc:
        raise body_error(exc) from None
    return await _off_loop_if(len(body.tokens), detokenize_response, service.tokenizer, body)


def install_tokenize_routes(app: FastAPI, service: GenerationService) -> None:
    """Add ``POST /tokenize`` and ``POST /detokenize``."""

    @app.post("/tokenize")
    async def tokenize_route(raw_request: Request) -> TokenizeResponse:
        """Token ids of a prompt or of chat messages (vLLM's ``/tokenize``)."""
        return await tokenize(service, raw_request)

    @app.post("/detokenize")
    async def detokenize_route(raw_request: Request) -> DetokenizeResponse:
        """The text of token ids (vLLM's ``/detokenize``)."""
        return await detokenize(service, raw_request)
