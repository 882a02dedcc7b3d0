"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, and what they compute over a
``Tokenizer`` (torch-free): the server and the gateway both answer with these, so they agree.

A tokenize body is a completion prompt (``prompt``) or chat messages (``messages``), never both. Its
ids are the ones generation uses: ``tokenizer.encode`` of the prompt, or of the chat template's
text. ``add_special_tokens`` adds the BOS/EOS the model's tokenizer asks for (default: true for a
prompt, false for messages, whose template writes its own); ``add_generation_prompt`` (default
true) ends the text with the assistant's turn opening; ``continue_final_message`` leaves the last
message open instead. ``tools`` are rendered as chat completions render them (the template's ``tools``
variable, or kvhive's own format for a template without tool support), so the ids are the ones a
chat completion with those tools computes. vLLM fields kvhive cannot honour (a custom
``chat_template``, multimodal options) are refused by name, never ignored, and so is any field not declared here
(``StrictBody``). Every problem is a ``BodyError`` naming its field; the caller answers it as a 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from kvhive.core.chat_template import ContinuationError
from kvhive.core.json_body import BodyError, ListOf
from kvhive.core.request_fields import StrictBody
from kvhive.core.tokenizer import Tokenizer
from kvhive.core.tool_definitions import chat_functions, chat_template_input

# Most variables ``chat_template_kwargs`` may hand the chat template.
MAX_TEMPLATE_KWARGS = 32
# Template variables the request sets through its own fields, never through ``chat_template_kwargs``.
_RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message"})
# Longest name of a ``chat_template_kwargs`` variable.
MAX_TEMPLATE_KWARG_CHARS = 64
# vLLM fields of a chat tokenize body that kvhive refuses unless left unset (or empty).
_REFUSED_CHAT_FIELDS = ("chat_template", "mm_processor_kwargs", "media_io_kwargs")


class TokenizeContentPart(StrictBody):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is rendered (the other
    kinds' fields are declared so that the refusal names the part's type)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ToolCallFunction(StrictBody):
    """The function a call in the history called, and its arguments as JSON text."""

    name: str
    arguments: str


class MessageToolCall(StrictBody):
    """One call an assistant message in the history made (``tool_calls``)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TokenizeMessage(StrictBody):
    """One chat message, as ``/v1/chat/completions`` takes it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | ListOf[TokenizeContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: ListOf[MessageToolCall] | None = None


class TokenizeCompletionRequest(StrictBody):
    """``POST /tokenize`` with a completion prompt."""

    model: str | None = None                # None: the served model
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(StrictBody):
    """``POST /tokenize`` with chat messages, rendered by the model's chat template."""

    model: str | None = None
    messages: ListOf[TokenizeMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None     # more variables for the template
    chat_template: str | None = None                       # refused: the model's own template only
    tools: ListOf[dict[str, Any]] | None = None            # as chat completions' ``tools``
    mm_processor_kwargs: dict[str, Any] | None = None      # refused: text only
    media_io_kwargs: dict[str, Any] | None = None          # refused: text only


class DetokenizeRequest(StrictBody):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: ListOf[int]


class TokenizeResponse(BaseModel):
    """The answer of ``/tokenize``: the ids, their count, the model's context length, and each
    token's text when ``return_token_strs`` asked for it."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """The answer of ``/detokenize``: the text of the ids (special tokens written out)."""

    prompt: str


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_model_for(data: Mapping[str, Any]) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """The body model a parsed ``/tokenize`` object is read as: chat with ``messages``, else a
    prompt; BodyError when it names both."""
    if "messages" in data and "prompt" in data:
        raise BodyError("Give either 'prompt' or 'messages', not both", param="prompt")
    return TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest


def check_tokenize_request(body: TokenizeRequest) -> None:
    """BodyError for fields kvhive cannot honour or that contradict each other."""
    if isinstance(body, TokenizeCompletionRequest):
        return
    for name in _REFUSED_CHAT_FIELDS:
        if getattr(body, name):
            raise BodyError(f"'{name}' is not supported; leave it unset", param=name)
    if body.continue_final_message and body.add_generation_prompt:
        raise BodyError("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                        "(set 'add_generation_prompt': false)", param="continue_final_message")
    if not body.messages:
        raise BodyError("'messages' must contain at least one message", param="messages")
    check_template_kwargs(body.chat_template_kwargs)


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> None:
    """BodyError for ``chat_template_kwargs`` over MAX_TEMPLATE_KWARGS variables, a name over
    MAX_TEMPLATE_KWARG_CHARS characters, or a variable the request sets through a field of its own
    (``messages``, ``tools``, ``add_generation_prompt``, ``continue_final_message``)."""
    kwargs = kwargs or {}
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise BodyError(f"'chat_template_kwargs' holds {len(kwargs)} variables; at most "
                        f"{MAX_TEMPLATE_KWARGS}", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if reserved:
        raise BodyError(f"'chat_template_kwargs' may not set '{reserved[0]}' (a field of its own)",
                        param="chat_template_kwargs")
    long = next((k for k in kwargs if len(k) > MAX_TEMPLATE_KWARG_CHARS), None)
    if long is not None:
        raise BodyError(f"'chat_template_kwargs' variable names are at most {MAX_TEMPLATE_KWARG_CHARS} "
                        f"characters (got {long[:MAX_TEMPLATE_KWARG_CHARS]!r}...)", param="chat_template_kwargs")


def chat_input(tokenizer: Tokenizer, messages: list[dict[str, Any]], body: TokenizeChatRequest
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages (as the template takes them) and template variables that render the body's
    chat with its ``tools``, as a chat completion's are rendered
    (``kvhive.core.tool_definitions.chat_template_input``); BodyError naming a wrong tool or call."""
    return chat_template_input(tokenizer.chat_template, messages, chat_functions(body.tools))


def chat_text(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], body: TokenizeChatRequest,
              variables: Mapping[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` (``chat_input``'s, with its ``variables``); with
    ``continue_final_message`` it ends where the last message's content does. Raises what the
    template raises (ValueError, jinja2's TemplateError)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             **(body.chat_template_kwargs or {}), **(variables or {}))
    except ContinuationError as exc:
        raise BodyError(f"'continue_final_message': {exc}", param="continue_final_message") from None


def chat_token_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], body: TokenizeChatRequest,
                   variables: Mapping[str, Any] | None = None) -> list[int]:
    """The ids of ``chat_text`` (BOS/EOS added only with ``add_special_tokens``: the template writes
    its own); with the defaults these are ``tokenizer.encode_chat(messages, **variables)``."""
    return tokenizer.encode(chat_text(tokenizer, messages, body, variables),
                            add_special_tokens=body.add_special_tokens)


def prompt_token_ids(tokenizer: Tokenizer, body: TokenizeCompletionRequest) -> list[int]:
    """The ids of the prompt, with the model's BOS/EOS when ``add_special_tokens`` (the default)."""
    return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def tokenize_response(tokenizer: Tokenizer, ids: list[int], max_model_len: int, body: TokenizeRequest
                      ) -> TokenizeResponse:
    """The answer for ``ids``; ``token_strs`` (each token's vocabulary piece, as vLLM gives them:
    "Ġworld" for a byte-level BPE, "▁the" for SentencePiece) when the body asks for them."""
    strs = [tokenizer.token_piece(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def check_detokenize_request(body: DetokenizeRequest, vocab_size: int, max_tokens: int) -> None:
    """BodyError for more than ``max_tokens`` ids or an id outside [0, ``vocab_size``)."""
    if len(body.tokens) > max_tokens:
        raise BodyError(f"'tokens' holds {len(body.tokens)} ids; at most {max_tokens} (the model's "
                        f"context length)", param="tokens")
    for i, token_id in enumerate(body.tokens):
        if not 0 <= token_id < vocab_size:
            raise BodyError(f"Token id {token_id} in 'tokens' is outside the vocabulary [0, {vocab_size})",
                            param=f"tokens[{i}]")


def detokenize_response(tokenizer: Tokenizer, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of the ids, special tokens written out (``<|im_start|>``), as vLLM answers it."""
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
