"""Pydantic schemas of Anthropic's Messages API as kvhive serves it (``POST /v1/messages`` and
``/v1/messages/count_tokens``; docs/anthropic.md).

Requests are strict (``StrictBody``): an undeclared field is a 400 naming it, and every field is
bounded. ``system``, ``messages``, ``tools`` and ``tool_choice`` are checked block by block, with the
block's path in the error, by ``kvhive.core.anthropic_messages`` (the gateway renders with it too).
Responses are plain models in Anthropic's field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from kvhive.core.json_body import ListOf
from kvhive.core.request_fields import StrictBody

# Bounds: stop sequences (count and length), metadata's user id (Anthropic's 256), the model's
# name, the output asked for (checked against the context too), top_k.
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
MAX_USER_ID_CHARS = 256
MAX_MODEL_CHARS = 256
MAX_OUTPUT_TOKENS = 1 << 20
MAX_TOP_K = 1 << 20
StopSequence = Annotated[str, Field(max_length=MAX_STOP_SEQUENCE_CHARS)]


class MessagesMetadata(StrictBody):
    """``metadata``: ``user_id``, an opaque end-user id for abuse monitoring (a no-op: it never
    changes the output)."""

    user_id: str | None = Field(default=None, max_length=MAX_USER_ID_CHARS)


class ThinkingConfig(StrictBody):
    """``thinking``: only ``{"type": "disabled"}`` is served (extended thinking is refused)."""

    type: str = Field(max_length=32)
    budget_tokens: int | None = None
    display: str | None = Field(default=None, max_length=32)


class MessagesInput(StrictBody):
    """What both endpoints read: the model, the prompt's parts and its cache breakpoints."""

    model: str = Field(max_length=MAX_MODEL_CHARS)
    messages: ListOf[Any]
    system: str | ListOf[Any] | None = None
    tools: ListOf[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(MessagesInput):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1, le=MAX_OUTPUT_TOKENS)
    stop_sequences: ListOf[StopSequence] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    # Unset: the model's generation_config.json default (--generation-config), else Anthropic's 1.0.
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)      # 0: disabled
    metadata: MessagesMetadata | None = None                         # no-op
    service_tier: Literal["auto", "standard_only"] | None = None     # no-op: one server, one tier
    # kvhive's: prompt token ranges kept at a priority (TensorRT-LLM's KvCacheRetentionConfig).
    kv_cache_retention_config: dict[str, Any] | None = None


class CountTokensRequest(MessagesInput):
    """``POST /v1/messages/count_tokens``."""


# ---------------------------------------------------------------- responses


class MessagesUsage(BaseModel):
    """Anthropic's usage: the prompt split into tokens read from the cache, written to it at the
    breakpoints, and the rest (``input_tokens``); their sum is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class TextBlock(BaseModel):
    """A text content block of the answer."""

    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    """A call of a tool, its input parsed."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesResponse(BaseModel):
    """The answer of ``POST /v1/messages``."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    """The answer of ``POST /v1/messages/count_tokens``."""

    input_tokens: int
