"""The request bodies and session headers in the app's OpenAPI schema (``/openapi.json``).

Routes read their own JSON (``kvhive.server.request_body``: depth and Unicode checks before
pydantic, OpenAI-shaped 400s), so FastAPI cannot infer their bodies; they are declared here from
the same pydantic models the routes validate with, so clients and fuzzers see what is accepted.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvhive.core.tokenize_bodies import DetokenizeRequest, TokenizeCompletionRequest
from kvhive.server.chat_protocol import ChatCompletionRequest
from kvhive.server.messages_errors import MESSAGES_PATH
from kvhive.server.messages_protocol import CountTokensRequest, MessagesRequest
from kvhive.server.protocol import CompletionRequest
from kvhive.server.responses_protocol import ResponsesRequest
from kvhive.server.tokenize import ChatTokenizeRequest

_REF = "#/components/schemas/{model}"
_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                                        TokenizeCompletionRequest, ChatTokenizeRequest, DetokenizeRequest,
                                        MessagesRequest, CountTokensRequest)
# PATCH /v1/context/{session_id}: the TTL may also come in x-session-ttl, so the body is optional.
_TTL_BODY = {"type": "object", "properties": {"ttl": {"type": "integer", "minimum": 1,
                                                      "description": "seconds from now"}}}
# POST /v1/context/{session_id}/fork: both fields optional (the TTL may come in x-session-ttl).
_FORK_BODY = {"type": "object", "additionalProperties": False, "properties": {
    "ttl": {"type": "integer", "minimum": 1, "description": "the new session's TTL in seconds (default: the parent's)"},
    "turn": {"type": "integer", "minimum": 1, "description": "fork at the state after this turn (default: the latest)"}}}
_SESSION_ID = {"name": "x-session-id", "in": "header", "required": False, "schema": {"type": "string"},
               "description": "run the request in this session (from POST /v1/context)"}
# ``kvhive.server.errors.APIError.body``: every error status answers this shape.
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
# ``kvhive.server.messages_errors.anthropic_error_body``: the error shape on /v1/messages*.
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_SESSION_TTL = {"name": "x-session-ttl", "in": "header", "required": False, "schema": {"type": "string"},
                "description": "the session's time to live in seconds"}


def _bodies(model_name: str) -> dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], bool]]:
    """(path, method) -> (schema, example, required) of each route that reads a body."""
    ref = {model: {"$ref": _REF.format(model=model.__name__)} for model in _MODELS}
    chat = {"model": model_name, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
    completion = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 8}
    return {
        ("/v1/completions", "post"): (ref[CompletionRequest], completion, True),
        ("/v1/chat/completions", "post"): (ref[ChatCompletionRequest], chat, True),
        ("/v1/context", "post"): ({"anyOf": [ref[ChatCompletionRequest], ref[CompletionRequest]]}, chat, True),
        ("/v1/responses", "post"): (ref[ResponsesRequest], {"model": model_name, "input": "Say hi",
                                                           "max_output_tokens": 8}, True),
        ("/v1/context/{session_id}", "patch"): (_TTL_BODY, {"ttl": 600}, False),
        ("/v1/context/{session_id}/fork", "post"): (_FORK_BODY, {"ttl": 600, "turn": 1}, False),
        ("/tokenize", "post"): ({"anyOf": [ref[TokenizeCompletionRequest], ref[ChatTokenizeRequest]]},
                                {"model": model_name, "prompt": "Once upon a time"}, True),
        ("/detokenize", "post"): (ref[DetokenizeRequest], {"model": model_name, "tokens": [19556, 905]}, True),
        ("/v1/messages", "post"): (ref[MessagesRequest], chat, True),
        ("/v1/messages/count_tokens", "post"): (ref[CountTokensRequest], {k: v for k, v in chat.items()
                                                                          if k != "max_tokens"}, True),
    }


# (path, method) -> the session headers the route reads.
_HEADERS = {
    ("/v1/completions", "post"): [_SESSION_ID],
    ("/v1/chat/completions", "post"): [_SESSION_ID],
    ("/v1/context", "post"): [_SESSION_TTL],
    ("/v1/context/{session_id}", "patch"): [_SESSION_TTL],
    ("/v1/context/{session_id}/fork", "post"): [_SESSION_TTL],
}


def add_request_bodies(schema: dict[str, Any], model_name: str) -> None:
    """Declare the JSON bodies (with an example naming ``model_name``) and session headers in ``schema``."""
    _, definitions = models_json_schema([(model, "validation") for model in _MODELS], ref_template=_REF)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(definitions["$defs"], Error=_ERROR, AnthropicError=_ANTHROPIC_ERROR)
    paths = schema.get("paths", {})
    for path, operations in paths.items():
        shape = "AnthropicError" if path.startswith(MESSAGES_PATH) else "Error"
        error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model=shape)}}}}
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            # Validation errors are 400s (``install_error_handlers``), never FastAPI's 422.
            responses.pop("422", None)
            responses["400"] = {"description": f"Invalid request ({shape})", **error}
    for unused in ("HTTPValidationError", "ValidationError"):           # FastAPI's 422 bodies
        components.pop(unused, None)
    for (path, method), (body, example, required) in _bodies(model_name).items():
        operation = paths.get(path, {}).get(method)
        if operation is None:
            continue                    # a route this app does not serve
        operation["requestBody"] = {"required": required, "content": {
            "application/json": {"schema": body, "example": example}}}
        operation["responses"]["413"] = {"description": "The body exceeds --max-request-bytes",
                                         "content": operation["responses"]["400"]["content"]}
    for (path, method), headers in _HEADERS.items():
        operation = paths.get(path, {}).get(method)
        if operation is not None:
            operation.setdefault("parameters", []).extend(headers)


def install_request_bodies(app: FastAPI, model_name: str) -> None:
    """Make ``app.openapi()`` declare the request bodies and session headers (built once, then cached)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_request_bodies(build(), model_name)      # build() caches its dict in app.openapi_schema
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi              # type: ignore[method-assign]
