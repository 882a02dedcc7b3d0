"""Every request model refuses undeclared fields (``StrictBody``) and the OpenAPI schema says so;
the error names the field's path; the no-op allow-list is declared where it says and documented in
docs/api_fields.md; the gateway's chat bodies take the same fields as the server's."""

from __future__ import annotations

import os
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from support.servers import REPO_ROOT

from kvhive.core.json_body import BodyError, parse_chosen_body, validation_body_error
from kvhive.core.request_fields import NO_OP_FIELDS, UNRECOGNIZED_FIELD
from kvhive.core.tokenize_bodies import TokenizeChatRequest, TokenizeContentPart, TokenizeMessage
from kvhive.gateway.tokenize_api import check_text_parts
from kvhive.server.chat_protocol import ChatCompletionRequest, ChatMessage, ContentPart
from kvhive.server.openapi import _MODELS
from kvhive.server.protocol import CompletionRequest
from kvhive.server.responses_protocol import OtherInputItem, ResponsesRequest

# Objects that take any field: a Responses input item of a type kvhive refuses by that type.
OPEN_OBJECTS = {OtherInputItem.__name__}
ENDPOINT_MODELS: dict[str, type[BaseModel]] = {"completions": CompletionRequest,
                                                "chat completions": ChatCompletionRequest,
                                                "responses": ResponsesRequest}


def schema_definitions() -> dict[str, Any]:
    _, definitions = models_json_schema([(model, "validation") for model in _MODELS])
    return definitions["$defs"]


def test_every_request_object_refuses_undeclared_fields_and_the_schema_says_so() -> None:
    definitions = schema_definitions()
    assert {"ChatCompletionRequest", "ChatMessage", "ContentPart", "StreamOptions", "InputItem", "InputPart",
            "TokenizeCompletionRequest", "DetokenizeRequest"} <= set(definitions)
    for name, definition in definitions.items():
        if definition.get("type") != "object" or name in OPEN_OBJECTS:
            continue
        assert definition.get("additionalProperties") is False, name


def error_of(model: type[BaseModel], data: dict[str, Any]) -> BodyError:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    return validation_body_error(caught.value.errors())


@pytest.mark.parametrize(("data", "param"), [
    ({"model": "m", "messages": [], "foo": 1}, "foo"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "bar": 1}]}, "messages[0].bar"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "b": 1}]}]},
     "messages[0].content[0].b"),
    ({"model": "m", "messages": [], "stream_options": {"include_usage": True, "Odd Key": 1}}, "stream_options.Odd Key"),
    ({"model": "m", "messages": [], "k" * 100: 1}, "k" * 61 + "..."),
    # An unknown field is named even beside a wrong value of a known one.
    ({"model": 5, "messages": [], "foo": 1}, "foo"),
])
def test_an_unknown_field_is_named_by_its_path(data: dict[str, Any], param: str) -> None:
    error = error_of(ChatCompletionRequest, data)
    assert error.param == param and error.message == UNRECOGNIZED_FIELD.format(param)


def test_the_gateway_parses_tokenize_bodies_as_strictly() -> None:
    with pytest.raises(BodyError) as caught:
        parse_chosen_body(b'{"messages": [{"role": "user", "content": "x"}], "tools_x": 1}',
                          lambda _data: TokenizeChatRequest)
    assert caught.value.param == "tools_x"
    # The gateway's chat messages and parts take what the server's take: neither refuses the other's.
    assert set(TokenizeMessage.model_fields) == set(ChatMessage.model_fields)
    assert set(TokenizeContentPart.model_fields) == set(ContentPart.model_fields)


def test_the_gateway_refuses_another_part_kinds_field_on_a_text_part() -> None:
    body = TokenizeChatRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "text", "text": "y", "image_url": {"url": "u"}}]}]})
    with pytest.raises(BodyError) as caught:
        check_text_parts(body.messages)
    assert caught.value.param == "messages[0].content[1].image_url"


def test_no_op_fields_are_declared_where_listed_and_documented() -> None:
    with open(os.path.join(REPO_ROOT, "docs", "api_fields.md"), encoding="utf-8") as f:
        doc = f.read()
    for name, (endpoints, reason) in NO_OP_FIELDS.items():
        assert f"| `{name}` | {endpoints} |" in doc, name
        assert reason
        for endpoint in endpoints.split(", "):
            assert name in ENDPOINT_MODELS[endpoint].model_fields, (name, endpoint)
    # Bounded like every field: free text at most 256 characters.
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [], "safety_identifier": "x" * 257})
