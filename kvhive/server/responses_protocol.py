"""Schemas of ``/v1/responses`` (text and function calls): the request, its input items, the response
object, events.

Requests are strict like the other endpoints' (``StrictBody``: an unknown field is a 400 naming it).
Every declared field that would change the result and that kvhive does not implement answers 400
in ``check_unsupported`` unless it asks for the default, so nothing is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from kvhive.core.json_body import ListOf
from kvhive.core.request_fields import (
    TEXT_PART_FIELDS,
    NoOpText,
    PromptCacheKey,
    PromptCacheRetention,
    StrictBody,
)
from kvhive.request import MAX_LOGPROBS
from kvhive.server.chat_protocol import ChatTokenLogprob
from kvhive.server.errors import bad_request
from kvhive.server.protocol import MAX_SCHEDULING_PRIORITY, MIN_SCHEDULING_PRIORITY, check_metadata
from kvhive.server.sse import sse_named_event

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")
# The one ``include`` value supported: the logprobs of the output text's tokens.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# The fields of a text part: an earlier response's output_text sent back carries its annotations and logprobs.
OUTPUT_TEXT_FIELDS = TEXT_PART_FIELDS | {"annotations", "logprobs"}

# ---------------------------------------------------------------- request


class InputPart(StrictBody):
    """One content part of an input message; only text parts are supported. The other part kinds'
    fields are declared so that the refusal names the part's type; ``annotations`` and
    ``logprobs`` come back on an earlier response's ``output_text`` sent as input and are dropped
    (they describe that output, not what to generate)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    image_url: Any = None                   # refused: type "input_image"
    file_id: Any = None                     # refused: types "input_image", "input_file"
    detail: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None


class OtherInputItem(BaseModel):
    """An input item of another type (``reasoning``, ...): read only so that ``input_items`` refuses
    it by its ``type``, whatever fields its kind has."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str


CALL_ITEM_TYPES = ("function_call", "function_call_output")


def _item_kind(value: Any) -> str:
    """The tag of an input item: a message (``type`` "message" or absent), a function call or its
    output, or another kind."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in (None, "message"):
        return "Message"
    return "Call" if kind in CALL_ITEM_TYPES else "Other"


class InputItem(StrictBody):
    """One input message (``type`` "message" or absent). An earlier response's output message sent
    back as input carries its ``id`` and ``status``: accepted, and rendered by its role and content
    like any message."""

    type: str | None = None
    role: str | None = None
    content: str | ListOf[InputPart] | None = None
    id: str | None = None
    status: str | None = None


class CallInputItem(StrictBody):
    """A ``function_call`` the model made earlier (``call_id``, ``name``, ``arguments``) or a
    ``function_call_output`` (``call_id``, ``output``); ``id`` and ``status`` as an earlier
    response's output item carries them (accepted, not rendered)."""

    type: Literal["function_call", "function_call_output"]
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | ListOf[InputPart] | None = None
    id: str | None = None
    status: str | None = None


# Tags that are no field names (``param_from_loc`` leaves them out of a ``param``).
AnyInputItem = Annotated[Annotated[InputItem, Tag("Message")] | Annotated[CallInputItem, Tag("Call")]
                         | Annotated[OtherInputItem, Tag("Other")], Discriminator(_item_kind)]


class ResponsesRequest(StrictBody):
    """``POST /v1/responses``."""

    model: str
    input: str | ListOf[AnyInputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = None
    # Unset: the model's generation_config.json default (--generation-config), else OpenAI's.
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's admission order under --scheduling-policy priority (lower first); else only 0.
    priority: int = Field(default=0, ge=MIN_SCHEDULING_PRIORITY, le=MAX_SCHEDULING_PRIORITY)
    # Prompt-cache fields (kvhive.server.prompt_cache): OpenAI's routing key and pin, TensorRT-LLM's retention.
    prompt_cache_key: PromptCacheKey | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    kv_cache_retention_config: dict[str, Any] | None = None
    # No-ops (kvhive.core.request_fields.NO_OP_FIELDS): nothing here changes the output.
    user: NoOpText | None = None
    safety_identifier: NoOpText | None = None
    service_tier: NoOpText | None = None
    tools: ListOf[Any] | None = None                 # checked in kvhive.server.tools
    tool_choice: str | dict[str, Any] | None = None
    # Not implemented: 400 unless absent or the default (check_unsupported).
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None


def check_unsupported(body: ResponsesRequest) -> None:
    """400 for every feature that would change the result and that kvhive does not implement."""
    text = body.text or {}          # its ``format``: kvhive.server.structured.text_format_output
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported", param="text.verbosity")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise bad_request("'reasoning' is not supported (the model does not reason)", param="reasoning")
    for value in body.include or ():
        if value != INCLUDE_LOGPROBS:
            raise bad_request(f"'include' value {value!r} is not supported; only {INCLUDE_LOGPROBS!r}",
                              param="include")
    if body.background:
        raise bad_request("'background' responses are not supported", param="background")
    if body.truncation not in (None, "disabled"):
        raise bad_request("Only truncation 'disabled' is supported", param="truncation")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}",
                          param="top_logprobs")
    if body.top_logprobs and INCLUDE_LOGPROBS not in (body.include or ()):
        raise bad_request(f"'top_logprobs' needs 'include': [{INCLUDE_LOGPROBS!r}]", param="top_logprobs")
    if body.conversation is not None:
        raise bad_request("'conversation' is not supported; continue a response with "
                          "'previous_response_id'", param="conversation")
    if body.prompt is not None:
        raise bad_request("Prompt templates ('prompt') are not supported", param="prompt")
    if body.metadata is not None:
        check_metadata(body.metadata)


def logprobs_wanted(body: ResponsesRequest) -> int | None:
    """How many top alternatives per output token to report (None: no logprobs); call after
    ``check_unsupported``."""
    if INCLUDE_LOGPROBS not in (body.include or ()):
        return None
    return body.top_logprobs or 0


# ---------------------------------------------------------------- response object


class OutputText(BaseModel):
    """The text part of the output message."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    # Per token: its string, logprob, bytes and top alternatives (the chat shape); empty unless
    # ``include`` asks for them.
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The output message."""

    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    """A call the model made (an output item)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    """Input tokens served from cached KV."""

    cached_tokens: int


class OutputTokensDetails(BaseModel):
    """Always zero: the model does not reason."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is incomplete."""

    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    """Why a response failed: an engine error, or its record could not be written (a full disk)."""

    code: Literal["server_error", "insufficient_storage", "storage_error"] = "server_error"
    message: str


class ResponseObject(BaseModel):
    """The response object (``POST`` and ``GET /v1/responses/{id}``, and inside stream events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None = None
    model: str
    output: list[OutputMessage | FunctionCallItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None
    reasoning: dict[str, None] = Field(default_factory=lambda: {"effort": None, "summary": None})
    service_tier: str = "default"
    store: bool
    temperature: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int
    top_p: float
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    prompt_cache_key: str | None = None           # echoed as sent
    prompt_cache_retention: str | None = None


def output_text(response: dict[str, Any]) -> str:
    """The text of a (stored) response object's output message."""
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


# ---------------------------------------------------------------- stream events


def jsonable(value: Any) -> Any:
    """A field of an event as JSON data: models dumped, lists of them too."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


class EventWriter:
    """Frames stream events as SSE (``event: <type>`` and JSON data) with increasing sequence numbers."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event_type: str, **fields: Any) -> str:
        """One event; ``BaseModel`` fields (and lists of them) are dumped as JSON objects."""
        data = {"type": event_type, "sequence_number": self.sequence_number,
                **{k: jsonable(v) for k, v in fields.items()}}
        self.sequence_number += 1
        return sse_named_event(event_type, data)
