"""A route's JSON body, parsed once: a JSON object (``load_json``: depth, UTF-8, no lone surrogate;
linear in the body's size), then a pydantic model, with OpenAI-shaped 400s. A body of
OFF_LOOP_BODY_BYTES or more is parsed and validated off the event loop. The body's size is
``BodyLimitMiddleware``'s (413 while it is read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from kvhive.core import json_body
from kvhive.core.json_body import OFF_LOOP_BODY_BYTES, BodyError, off_loop_for
from kvhive.server.errors import body_error

BodyT = TypeVar("BodyT", bound=BaseModel)
__all__ = ["OFF_LOOP_BODY_BYTES", "parse_body", "parse_body_as", "parse_chosen_body"]


def parse_chosen_body(raw: bytes, choose: Callable[[dict[str, Any]], type[BodyT]]) -> BodyT:
    """``raw`` as the model ``choose`` picks from the parsed object (parsed once); 400 naming the
    first bad field."""
    try:
        return json_body.parse_chosen_body(raw, choose)
    except BodyError as exc:
        raise body_error(exc) from None


async def parse_body_as(request: Request, choose: Callable[[dict[str, Any]], type[BodyT]]) -> BodyT:
    """The JSON body, whatever the Content-Type, as the model ``choose`` picks from the parsed
    object; 400 for bad JSON or bad fields; 413 for a body over the limit. A body of
    OFF_LOOP_BODY_BYTES or more is parsed off the event loop."""
    raw = await request.body()
    return await off_loop_for(raw, parse_chosen_body, raw, choose)


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The JSON body as ``model`` (``parse_body_as`` with one model)."""
    return await parse_body_as(request, lambda _data: model)
