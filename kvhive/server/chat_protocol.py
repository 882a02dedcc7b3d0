"""Pydantic schemas of ``/v1/chat/completions``: the request and its messages (strict, as
``kvhive.server.protocol``'s requests), the whole answer, the stream's chunks, and the chat form of
token logprobs (which ``/v1/responses`` reuses)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from kvhive.core.json_body import ListOf
from kvhive.core.request_fields import NoOpText, PromptCacheKey, PromptCacheRetention, StrictBody
from kvhive.core.tokenize_bodies import MessageToolCall, ToolCallFunction
from kvhive.server.protocol import OmitUnasked, PromptLogprobs, SamplingRequest, Usage
from kvhive.sessions.registry import MAX_SESSION_ID_CHARS, SESSION_ID_PATTERN


class ContentPart(StrictBody):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported. The
    other OpenAI part kinds' fields are declared so that the refusal names the part's type."""

    type: str
    text: str | None = None
    image_url: Any = None                   # refused: type "image_url"
    input_audio: Any = None                 # refused: type "input_audio"
    file: Any = None                        # refused: type "file"


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(StrictBody):
    """One chat message; ``content`` is a string or a list of text parts. An assistant message may
    carry ``tool_calls`` (its content then may be null); a ``tool`` message answers the call
    ``tool_call_id``."""

    role: Role
    content: str | ListOf[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: ListOf[MessageToolCall] | None = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: ListOf[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: ListOf[dict[str, Any]] | None = None          # checked in kvhive.server.tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    conversation_id: str | None = Field(default=None, max_length=MAX_SESSION_ID_CHARS,
                                       pattern=SESSION_ID_PATTERN)   # a session
    end_conversation: bool = False                      # free the conversation after this turn
    # More variables for the chat template (Qwen3's enable_thinking); bounded in check_template_kwargs.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: end the prompt with the assistant turn's opening (the default), or leave the last
    # message open for the model to go on with (a prefill; then no generation prompt).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the answer's content starts with the last message's when that is an assistant message
    # (with continue_final_message: the prefill and its continuation, whole).
    echo: bool = False
    # OpenAI's prompt-cache fields (kvhive.server.prompt_cache): the gateway's routing key, and a pin.
    prompt_cache_key: PromptCacheKey | None = None
    prompt_cache_retention: PromptCacheRetention | None = None
    # No-ops (NO_OP_FIELDS): nothing here changes the output.
    safety_identifier: NoOpText | None = None
    service_tier: NoOpText | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None


class ToolCall(BaseModel):
    """A call the model made: a fresh id, the function and its arguments as JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    """The generated message of a chat completion: its text (null when it only made calls) and its
    calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class TopLogprob(BaseModel):
    """A token and its logprob; ``token`` is ``bytes:\\x..`` when its bytes are not whole UTF-8."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    """A generated token's logprob, with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """``logprobs`` of a chat choice (or of a streamed chunk's tokens)."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class ChatChoice(OmitUnasked):
    """One choice of a chat completion."""

    OMIT_WHEN_NONE = frozenset({"token_ids"})

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None                  # vLLM's, with return_token_ids: the generated ids


class ChatCompletionResponse(OmitUnasked):
    """A non-streamed chat completion."""

    OMIT_WHEN_NONE = frozenset({"prompt_logprobs", "prompt_token_ids"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None    # a prefill's answer: the decode request's params
    prompt_logprobs: PromptLogprobs | None = None       # vLLM's, with prompt_logprobs
    prompt_token_ids: list[int] | None = None           # vLLM's, with return_token_ids


class DeltaFunction(BaseModel):
    """A streamed call's function: its name in the call's first chunk, then pieces of its arguments."""

    name: str | None = None
    arguments: str

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """A streamed call: ``index`` (its place among the choice's calls), with ``id`` and ``type`` in
    its first chunk."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    """What a streamed chat chunk adds to the message."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta names only what it adds: {"content": "x"}, {"role": "assistant", ...} or {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(OmitUnasked):
    """One choice of a streamed chat chunk."""

    OMIT_WHEN_NONE = frozenset({"token_ids"})

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None                  # vLLM's, with return_token_ids: this chunk's ids


class ChatCompletionChunk(OmitUnasked):
    """One ``data:`` event of a streamed chat completion."""

    OMIT_WHEN_NONE = frozenset({"prompt_token_ids"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None           # vLLM's, with return_token_ids: the first chunk only
