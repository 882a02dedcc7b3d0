"""Pydantic schemas the OpenAI routes share (the sampling fields, usage, ``metadata``, the model list)
and those of ``/v1/completions`` (requests strict, unknown fields refused; responses plain). Chat's are
in ``kvhive.server.chat_protocol``."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from kvhive.core.json_body import ListOf
from kvhive.core.request_fields import NoOpText, StrictBody
from kvhive.request import MAX_ABS_PENALTY, MAX_REPETITION_PENALTY, MIN_SEED, SEED_END
from kvhive.server.errors import bad_request

# OpenAI's bounds on ``metadata``.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# Bounds of vLLM's scheduling ``priority`` (a 32-bit signed integer; lower is admitted first).
MIN_SCHEDULING_PRIORITY, MAX_SCHEDULING_PRIORITY = -(2**31), 2**31 - 1
# Most stop strings and stop token ids a request may give, and the longest stop string: the text
# held back per generated character grows with the strings (``kvhive.server.stop``), and every
# generated token is checked against the ids on the engine's thread.
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
# The longest ``cache_salt``: it names a tenant of the prefix cache and of the speculative history.
MAX_CACHE_SALT_CHARS = 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# ---------------------------------------------------------------- requests
# Strict (``StrictBody``): "5" is not an integer and "true" is not a boolean, as in OpenAI's API, and
# a field not declared here is a 400 naming it. The few fields accepted as no-ops are
# ``kvhive.core.request_fields.NO_OP_FIELDS`` (docs/api_fields.md says why each is safe).


class StreamOptions(StrictBody):
    """``stream_options``: ``include_usage`` ends the stream with a usage chunk;
    ``continuous_usage_stats`` (vLLM's) also puts the choice's usage so far on every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputFields(StrictBody):
    """Fields that constrain the output (``kvhive.server.structured`` reads and bounds them):
    OpenAI's ``response_format``, then vLLM's extensions."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: ListOf[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class SamplingRequest(StructuredOutputFields):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    # Unset: the model's generation_config.json default (--generation-config), else OpenAI's.
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)      # vLLM extension; 0 or -1: disabled
    stop: StopString | Annotated[ListOf[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[ListOf[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None   # vLLM extension
    seed: int | None = Field(default=None, ge=MIN_SEED, lt=SEED_END)    # any signed or unsigned 64-bit
    ignore_eos: bool = False                            # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: NoOpText | None = None                        # no-op (NO_OP_FIELDS)
    cache_salt: str | None = Field(default=None, max_length=MAX_CACHE_SALT_CHARS)   # vLLM's: per-tenant prefix cache
    # TensorRT-LLM's shape, checked and bounded in kvhive.server.prompt_cache (docs/prompt_caching.md).
    kv_cache_retention_config: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None    # vLLM's field: disaggregated prefill/decode
    presence_penalty: float | None = Field(default=None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)   # None: 0
    frequency_penalty: float | None = Field(default=None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    logit_bias: dict[str, float] | None = None          # token id -> bias in [-100, 100]
    # vLLM's sampling extensions (docs/api_fields.md).
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY)
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = None                  # vLLM extension: the prompt tokens' logprobs
    return_token_ids: bool = False                      # vLLM extension: prompt and generated token ids
    # vLLM's admission order under --scheduling-policy priority (lower first); else only 0.
    priority: int = Field(default=0, ge=MIN_SCHEDULING_PRIORITY, le=MAX_SCHEDULING_PRIORITY)
    # In a session: the turn this request is (1 = its first); 409 unless it is the session's next.
    turn_number: int | None = Field(default=None, ge=1, le=2**31 - 1)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """True when every streamed chunk carries its choice's usage so far."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

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


def check_metadata(metadata: dict[str, str]) -> None:
    """400 beyond OpenAI's bounds on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise bad_request(f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
                          param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters and values "
                              f"at most {MAX_METADATA_VALUE_CHARS} (key {key[:80]!r})", param="metadata")


# ---------------------------------------------------------------- responses


class OmitUnasked(BaseModel):
    """A response model whose vLLM-only fields (``OMIT_WHEN_NONE``) are left out unless set: they
    appear only when the request asked for them."""

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k not in self.OMIT_WHEN_NONE}


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


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one token at a prompt position: its logprob, its rank
    there (1: most likely; null for the prompt's own token when it is outside the top ranks) and text."""

    logprob: float
    rank: int | None
    decoded_token: str


# ``prompt_logprobs``: per prompt position, token id -> PromptLogprob; the first position is null.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OmitUnasked):
    """One choice of a completion (or a streamed completion chunk); the vLLM fields are there only when
    asked (``return_token_ids``, ``prompt_logprobs``)."""

    OMIT_WHEN_NONE = frozenset({"token_ids", "prompt_token_ids", "prompt_logprobs"})

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None                  # generated (in a chunk: this chunk's)
    prompt_token_ids: list[int] | None = None           # in a stream: the choice's first chunk only
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same ``object`` in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None    # a prefill's answer: the decode request's params


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
