"""Pydantic schemas of the OpenAI API subset kvhive serves (requests strict, responses plain)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from kvhive.core.json_body import ListOf
from kvhive.request import MIN_SEED, SEED_END
from kvhive.sessions.registry import MAX_SESSION_ID_CHARS, SESSION_ID_PATTERN

# ---------------------------------------------------------------- requests
# Strict: "5" is not an integer and "true" is not a boolean, as in OpenAI's API. Unknown fields are
# ignored so clients that send newer OpenAI fields keep working.


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """``stream_options``: only ``include_usage`` changes anything."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)      # vLLM extension; 0 or -1: disabled
    stop: str | ListOf[str] | None = None
    stop_token_ids: ListOf[int] | None = None             # vLLM extension
    seed: int | None = Field(default=None, ge=MIN_SEED, lt=SEED_END)    # any signed or unsigned 64-bit
    ignore_eos: bool = False                            # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None                       # vLLM extension: per-tenant prefix cache
    kv_transfer_params: dict[str, Any] | None = None    # vLLM's field: disaggregated prefill/decode
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list, without empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | ListOf[int] | ListOf[str] | ListOf[ListOf[int]]
    # vLLM extension: a text prompt gets the BOS/EOS the model's tokenizer asks for (token ids are
    # used as given).
    add_special_tokens: bool = True
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(_Strict):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ToolCallFunction(_Strict):
    """The function a call in the history called, and its arguments as JSON text."""

    name: str
    arguments: str


class MessageToolCall(_Strict):
    """One call an assistant message in the history made (``tool_calls``)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
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
    response_format: dict[str, Any] | None = None
    conversation_id: str | None = Field(default=None, max_length=MAX_SESSION_ID_CHARS,
                                       pattern=SESSION_ID_PATTERN)   # a session
    end_conversation: bool = False                      # free the conversation after this turn


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    """Part of ``usage``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request; present on every response (and the streamed usage chunk)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """``logprobs`` of a completion choice: one entry per token in each list (legacy OpenAI shape)."""

    tokens: list[str]
    # With echo, the prompt's tokens come first; the first one's entries are null (nothing before it).
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the top tokens, and the chosen one, per position
    text_offset: list[int]                   # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    """One choice of a completion (or a streamed completion chunk)."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same ``object`` in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None    # a prefill's answer: the decode request's params


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


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = None    # a prefill's answer: the decode request's params


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


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvhive"
    max_model_len: int
    # The model fingerprint in kvhive's block hashes: a gateway needs it to name blocks as we do.
    kvhive_fingerprint: str | None = None
    kvhive_block_size: int | None = None
    kvhive_hash_seed: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
