"""The gateway's ``POST /tokenize`` and ``POST /detokenize``: answered with its own tokenizer, the one
it routes by (``kvhive.core.tokenize_bodies``, the replicas' shapes and checks).

What only a replica knows comes from one: the gateway asks the healthy replicas' ``/v1/models``
with the caller's ``Authorization`` header, so a replica's API key guards these routes as it
guards its own, an unknown ``model`` is a 404, and ``max_model_len`` is the replica's.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError

from kvhive.core.json_body import BodyError, off_loop_for, parse_chosen_body
from kvhive.core.request_fields import TEXT_PART_FIELDS, stray_field, stray_field_message
from kvhive.core.tokenize_bodies import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeMessage,
    TokenizeRequest,
    chat_input,
    chat_token_ids,
    check_detokenize_request,
    check_tokenize_request,
    detokenize_response,
    prompt_token_ids,
    tokenize_model_for,
    tokenize_response,
)
from kvhive.core.tokenizer import Tokenizer
from kvhive.routing.dialects import openai_error
from kvhive.routing.prompts import chat_messages

# Texts (characters) and id lists this long or longer are worked on the tokenizer pool.
OFF_LOOP_SIZE = 4096


class ModelUnknown(Exception):
    """The body names a model no replica serves."""


class TokenizeAPI:
    """``/tokenize`` and ``/detokenize`` over the gateway's tokenizer; ``list_models`` is the
    gateway's ``/v1/models`` (the healthy replicas' cards, merged), ``run`` its tokenizer pool."""

    def __init__(self, tokenizer: Tokenizer, list_models: Callable[[Request], Awaitable[Response]],
                 run: Callable[..., Awaitable[Any]]) -> None:
        self.tokenizer = tokenizer
        self.list_models = list_models
        self.run = run

    async def answer(self, request: Request, raw: bytes) -> Response:
        """The answer to a ``/tokenize`` or ``/detokenize`` request whose body is ``raw``."""
        models = await self.list_models(request)
        if models.status_code != 200:
            return models               # no replica, or the caller's key refused: as the replicas say
        cards = json.loads(bytes(models.body)).get("data") or []
        try:
            if request.url.path == "/detokenize":
                return await self.detokenize(raw, cards)
            return await self.tokenize(raw, cards)
        except BodyError as exc:
            return openai_error(400, exc.message, param=exc.param)
        except ModelUnknown as exc:
            return openai_error(404, str(exc), code="model_not_found", param="model")

    async def tokenize(self, raw: bytes, cards: Sequence[dict[str, Any]]) -> Response:
        """The ids of a prompt or of chat messages, as the replicas compute them."""
        body: TokenizeRequest = await off_loop_for(raw, parse_chosen_body, raw, tokenize_model_for)
        card = model_card(cards, body.model)
        check_tokenize_request(body)
        if isinstance(body, TokenizeChatRequest):
            messages = await off_loop_for(raw, template_input, body)
            ids = await self.chat_ids(body, messages)
        else:
            ids = await self.off_loop_if(len(body.prompt), prompt_token_ids, self.tokenizer, body)
        answer = await self.off_loop_if(len(ids) if body.return_token_strs else 0, tokenize_response,
                                        self.tokenizer, ids, card["max_model_len"], body)
        return JSONResponse(answer.model_dump(mode="json"))

    async def chat_ids(self, body: TokenizeChatRequest, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The ids of the body's ``messages`` (``template_input``) and ``tools`` through the chat
        template, rendered as the replicas render them (``chat_input``)."""
        rendered, variables = chat_input(self.tokenizer, list(messages), body)
        size = sum(len(m["content"]) for m in rendered) + len(str(variables.get("tools") or ""))
        try:
            return await self.off_loop_if(size, chat_token_ids, self.tokenizer, rendered, body, variables)
        except BodyError:
            raise
        except (TemplateError, ValueError) as exc:
            raise BodyError(f"Could not apply the chat template: {exc}", param="messages") from exc

    async def detokenize(self, raw: bytes, cards: Sequence[dict[str, Any]]) -> Response:
        """The text of token ids (special tokens written out)."""
        body = await off_loop_for(raw, parse_chosen_body, raw, lambda _data: DetokenizeRequest)
        card = model_card(cards, body.model)
        await off_loop_for(raw, check_detokenize_request, body, self.tokenizer.vocab_size, card["max_model_len"])
        answer = await self.off_loop_if(len(body.tokens), detokenize_response, self.tokenizer, body)
        return JSONResponse(answer.model_dump(mode="json"))

    async def off_loop_if(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, on the tokenizer pool when ``size`` reaches OFF_LOOP_SIZE."""
        return await self.run(fn, *args) if size >= OFF_LOOP_SIZE else fn(*args)


def template_input(body: TokenizeChatRequest) -> tuple[dict[str, Any], ...]:
    """The body's messages as the chat template takes them; BodyError for a part that is not text."""
    check_text_parts(body.messages)
    messages = chat_messages([m.model_dump() for m in body.messages])
    assert messages is not None                 # valid messages of text parts: always read
    return messages


def check_text_parts(messages: Sequence[TokenizeMessage]) -> None:
    """BodyError naming the first content part that is not text (the replicas read text only)."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise BodyError(f"Only text content parts are supported, got type '{part.type}'",
                                param=f"messages[{i}].content[{j}].type")
            stray = stray_field(part, TEXT_PART_FIELDS)
            if stray is not None:
                raise BodyError(stray_field_message(stray, part.type), param=f"messages[{i}].content[{j}].{stray}")


def model_card(cards: Sequence[dict[str, Any]], model: str | None) -> dict[str, Any]:
    """The replicas' card of ``model`` (None: the first), with an integer ``max_model_len``;
    ModelUnknown when no replica serves it."""
    known = [c for c in cards if isinstance(c, dict) and isinstance(c.get("max_model_len"), int)]
    found = [c for c in known if model is None or c.get("id") == model]
    if not found:
        served = ", ".join(f"`{c.get('id')}`" for c in known) or "none"
        raise ModelUnknown(f"The model `{model}` does not exist. Served model: {served}.")
    return found[0]
