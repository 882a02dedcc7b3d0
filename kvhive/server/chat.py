"""``POST /v1/chat/completions``: messages rendered with the model's chat template, ``n`` replies
(one by default), with the logprobs of their tokens when asked."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response
from jinja2 import TemplateError

from kvhive.core.chat_template import ContinuationError
from kvhive.core.json_body import BodyError
from kvhive.core.request_fields import TEXT_PART_FIELDS, stray_field, stray_field_message
from kvhive.core.tokenize_bodies import ToolCallFunction, check_template_kwargs
from kvhive.core.tool_definitions import chat_template_input
from kvhive.core.tool_parsers import ContentDelta
from kvhive.request import MAX_LOGPROBS
from kvhive.server.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
)
from kvhive.server.choices import choice_streams, merge_streams, whole_answer
from kvhive.server.errors import bad_request, body_error
from kvhive.server.generation import GenerationService
from kvhive.server.logprobs import SentToken, chat_logprobs, vllm_prompt_logprobs
from kvhive.server.protocol import PromptTokensDetails, Usage, check_metadata
from kvhive.server.request_checks import check_prompt_logprobs
from kvhive.server.response_identity import new_request_id, unix_time
from kvhive.server.sampling_fields import truncated_prompt
from kvhive.server.session_turns import open_session_after, session_headers, sse_response_ending_turns
from kvhive.server.sse import SSE_DONE, sse_event
from kvhive.server.structured import body_structured_spec
from kvhive.server.text_deltas import TextDelta, TextOptions, combined_usage
from kvhive.server.tool_output import CallBegun, OutputEvent, ToolOutputReader, read_whole
from kvhive.server.tools import (
    NO_PLAN,
    ToolPlan,
    chat_functions,
    tool_choice,
    tool_plan,
)


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.metadata is not None:
        check_metadata(body.metadata)


def logprobs_wanted(body: ChatCompletionRequest) -> int | None:
    """How many top alternatives per token the request wants (None: no logprobs); 400 if malformed."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}", param="top_logprobs")
    if top is not None and not body.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if body.logprobs else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: string content; ``developer`` is a system message;
    an assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` as sent."""
    if not messages:
        raise bad_request("'messages' must contain at least one message", param="messages")
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.content is None or isinstance(message.content, str):
            content = message.content or ""
        else:
            texts = []
            for j, part in enumerate(message.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"Only text content parts are supported, got type '{part.type}'",
                                      param=f"messages[{i}].content[{j}].type")
                stray = stray_field(part, TEXT_PART_FIELDS)
                if stray is not None:
                    raise bad_request(stray_field_message(stray, part.type), param=f"messages[{i}].content[{j}].{stray}")
                texts.append(part.text)
            content = "\n".join(texts)
        entry = {"role": "system" if message.role == "developer" else message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        rendered.append(entry)
    return rendered


class ChatOpening(NamedTuple):
    """How a chat prompt ends: with the assistant turn's opening (the default), after the last
    message's end (``add_generation_prompt`` false), or inside the last message, left open for the
    model to go on with (``continue_final_message``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ChatOpening:
        """The body's two fields; 400 when both are true (vLLM's rule)."""
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true "
                              "(set 'add_generation_prompt': false)", param="continue_final_message")
        return cls(body.add_generation_prompt, body.continue_final_message)


NEW_TURN = ChatOpening()


async def chat_prompt_token_ids(service: GenerationService, messages: list[ChatMessage],
                                param: str = "messages", template_kwargs: dict[str, Any] | None = None,
                                plan: ToolPlan = NO_PLAN, opening: ChatOpening = NEW_TURN) -> list[int]:
    """The messages (and the plan's tools) through the model's chat template (``template_kwargs``:
    more variables for it, checked by ``check_template_kwargs``; ``opening``: how the prompt ends),
    as token ids (a long prompt rendered off the event loop); 400 naming ``param`` when the template
    fails, or naming the history's call or tool result that is wrong, or ``continue_final_message``
    when the last message cannot be continued."""
    rendered = template_messages(messages)
    try:
        rendered, variables = chat_template_input(service.tokenizer.chat_template, rendered, plan.functions, param)
        check_template_kwargs(template_kwargs)
    except BodyError as exc:
        raise body_error(exc) from None
    try:
        return await service.encode_chat(rendered, template_kwargs, opening.add_generation_prompt,
                                         opening.continue_final_message, **variables)
    except ContinuationError as exc:
        raise bad_request(f"'continue_final_message': {exc}", param="continue_final_message") from exc
    except (TemplateError, ValueError) as exc:
        raise bad_request(f"Could not apply the chat template: {exc}", param=param) from exc



def stream_delta(events: list[OutputEvent]) -> DeltaMessage | None:
    """One chunk's delta of what a choice's output read into: its content and its calls' pieces
    (a call's first piece carries its id, type and name); None when there is nothing to send."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = []
    for event in events:
        if isinstance(event, CallBegun):
            calls.append(DeltaToolCall(index=event.index, id=event.call.id, type="function",
                                       function=DeltaFunction(name=event.call.name, arguments="")))
        elif not isinstance(event, ContentDelta):
            calls.append(DeltaToolCall(index=event.index, function=DeltaFunction(arguments=event.text)))
    if not content and not calls:
        return None
    return DeltaMessage(content=content or None, tool_calls=calls or None)


def echoed_content(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts before each choice's content: the last message's text when it is an
    assistant message (the role the answer has), else nothing, as vLLM echoes."""
    if not body.echo or not body.messages or body.messages[-1].role != "assistant":
        return ""
    return template_messages(body.messages[-1:])[0]["content"]


def max_tokens_field(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The output limit asked for and its field: ``max_completion_tokens``, else ``max_tokens``;
    both may be given with one value (clients that send both), never two (400: one would be
    ignored)."""
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise bad_request(f"'max_tokens' ({body.max_tokens}) and 'max_completion_tokens' "
                          f"({body.max_completion_tokens}) ask for different limits; send one",
                          param="max_tokens", code="invalid_parameter_combination")
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


@dataclass(frozen=True)
class ChatAnswer:
    """What one chat completion request answers, whole or streamed: assistant messages (deltas),
    with their tokens' logprobs when asked."""

    service: GenerationService
    body: ChatCompletionRequest
    num_logprobs: int | None                     # None: no logprobs
    prompt_token_ids: list[int] = field(default_factory=list)
    plan: ToolPlan = NO_PLAN
    echo: str = ""                               # the text each choice's content starts with (``echo``)
    request_id: str = field(default_factory=lambda: new_request_id("chatcmpl"))
    created: int = field(default_factory=unix_time)

    def logprobs_of(self, tokens: tuple[SentToken, ...]) -> ChatLogprobs | None:
        """The tokens' logprobs, when the request asked for them."""
        return None if self.num_logprobs is None else chat_logprobs(tokens, self.service.tokenizer)

    def ids(self, token_ids: tuple[int, ...] | list[int]) -> list[int] | None:
        """``token_ids`` when the request asked for ids (``return_token_ids``), else None."""
        return list(token_ids) if self.body.return_token_ids else None

    def response(self, results: list[TextDelta]) -> ChatCompletionResponse:
        """The non-streamed answer: one assistant message per choice (its text read for tool calls
        by the plan), and the usage; vLLM's ``prompt_logprobs`` and token ids when asked."""
        choices = []
        for i, result in enumerate(results):
            read = read_whole(self.plan, result.text)
            calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments_text))
                     for c in read.calls]
            content = self.echo + (read.content or "") if self.echo else read.content
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls),
                                      logprobs=self.logprobs_of(result.tokens),
                                      finish_reason=read.finish_reason(result.finish_reason or "stop"),
                                      token_ids=self.ids(result.token_ids)))
        scored = results[0].prompt_logprobs
        prompt_logprobs = (None if self.body.prompt_logprobs is None or scored is None
                           else vllm_prompt_logprobs(scored, self.service.tokenizer, self.body.prompt_logprobs))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.service.served_model_name,
                                      choices=choices, usage=combined_usage(results), prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=self.ids(self.prompt_token_ids))

    def chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None,
              prompt_token_ids: list[int] | None = None) -> str:
        """One SSE event of the stream (its ``usage`` field only when the request asked for usage)."""
        return sse_event(ChatCompletionChunk(id=self.request_id, created=self.created,
                                             model=self.service.served_model_name, choices=choices, usage=usage,
                                             prompt_token_ids=prompt_token_ids),
                         exclude=None if self.body.include_usage else {"usage"})

    def delta(self, index: int, delta: DeltaMessage, finish_reason: str | None = None,
              logprobs: ChatLogprobs | None = None, progress: TextDelta | None = None,
              token_ids: tuple[int, ...] = (), prompt_token_ids: list[int] | None = None) -> str:
        """The SSE event of one choice's delta; with ``continuous_usage_stats`` it carries the
        choice's usage as of ``progress`` (no output yet when None)."""
        usage = None
        if self.body.continuous_usage:
            usage = progress.usage() if progress is not None else Usage(
                prompt_tokens=len(self.prompt_token_ids), completion_tokens=0,
                total_tokens=len(self.prompt_token_ids), prompt_tokens_details=PromptTokensDetails())
        return self.chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                           token_ids=self.ids(token_ids))], usage, prompt_token_ids)

    async def events(self, streams: list[AsyncIterator[TextDelta]]) -> AsyncIterator[str]:
        """The SSE events: each choice's role (the first chunk carries the prompt's ids when asked),
        its deltas as they come and its finish reason, the usage when asked, then [DONE]."""
        for index in range(self.body.n):
            yield self.delta(index, DeltaMessage(role="assistant", content=""),
                             prompt_token_ids=self.ids(self.prompt_token_ids) if index == 0 else None)
            if self.echo:
                yield self.delta(index, DeltaMessage(content=self.echo))
        finals: dict[int, TextDelta] = {}
        readers = [ToolOutputReader(self.plan) for _ in range(self.body.n)]
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for index, delta in merged:
                reader = readers[index]
                message = stream_delta(reader.feed(delta.text) if delta.text else [])
                # A token without text of its own (the end-of-turn token) still has logprobs (and an id) to send.
                if message is not None or delta.tokens or (self.body.return_token_ids and delta.token_ids):
                    yield self.delta(index, message or DeltaMessage(content=""), logprobs=self.logprobs_of(delta.tokens),
                                     progress=delta, token_ids=delta.token_ids)
                if delta.finish_reason is None:
                    continue
                held = stream_delta(reader.finish())
                if held is not None:
                    yield self.delta(index, held, progress=delta)
                yield self.delta(index, DeltaMessage(), reader.finish_reason(delta.finish_reason), progress=delta)
                finals[index] = delta
        if self.body.include_usage:
            yield self.chunk([], usage=combined_usage([finals[i] for i in range(self.body.n)]))
        yield SSE_DONE


async def create_chat_completion(service: GenerationService, body: ChatCompletionRequest,
                                 raw_request: Request, new_session_ttl: int | None = None
                                 ) -> Response | ChatCompletionResponse:
    """Validate, run and answer one chat completion request (in a session: ``x-session-id`` or
    ``conversation_id``, or a new one with ``new_session_ttl``; the answer carries ``x-session-id``)."""
    service.check_common(body)
    _check_unsupported(body)
    check_prompt_logprobs(body)
    if body.prompt_logprobs is not None and (raw_request.headers.get("x-session-id") or body.conversation_id
                                             or new_session_ttl is not None):
        raise bad_request("'prompt_logprobs' cannot run in a session: they need every prompt token computed, "
                          "and a session reuses its tokens' KV", param="prompt_logprobs")
    if body.conversation_id is not None and not service.sessions.config.enable_conversation_caching:
        raise bad_request("'conversation_id' is off on this server (--no-enable-conversation-caching): "
                          "send the whole conversation without it (the prefix cache still serves its "
                          "prefix), or use x-session-id", param="conversation_id")
    kv_transfer = service.kv_transfer_params(body)
    num_logprobs = logprobs_wanted(body)
    structured = await body_structured_spec(service.engine, body)
    functions = chat_functions(body.tools)
    plan = await tool_plan(service.engine, service.tokenizer.chat_template, service.tool_call_parser, functions,
                           tool_choice(body.tool_choice, functions, flat=False), body.parallel_tool_calls)
    token_ids = truncated_prompt(await chat_prompt_token_ids(service, body.messages,
                                                             template_kwargs=body.chat_template_kwargs, plan=plan,
                                                             opening=ChatOpening.of(body)),
                                 body.truncate_prompt_tokens, service.max_model_len)
    requested, param = max_tokens_field(body)
    max_tokens = service.resolve_max_tokens(requested, len(token_ids), param, "messages")
    sampling = plan.with_spec(service.sampling_params(body, max_tokens, num_logprobs, body.prompt_logprobs,
                                                      structured))
    service.check_transfer_unconstrained(sampling.structured, kv_transfer)
    owner = service.owner_of(raw_request)
    salt = service.cache_salt_for(owner, body.cache_salt)
    cache = await service.open_cache(raw_request, body, token_ids, salt)
    turn = await open_session_after(service, cache, raw_request, body.model, len(token_ids) + max_tokens,
                                    conversation_id=body.conversation_id, new_ttl=new_session_ttl,
                                    end_session=body.end_conversation, n=body.n, turn_number=body.turn_number)
    headers = session_headers(turn)
    answer = ChatAnswer(service, body, num_logprobs, token_ids, plan, echoed_content(body))
    streams = choice_streams(service, answer.request_id, body.n, token_ids, sampling, body.stop_strings,
                             salt, turn, kv_transfer, TextOptions.of(body), cache, priority=body.priority)
    if not body.stream:
        return await whole_answer(streams, raw_request, headers,
                                  service.with_kv_transfer(answer.response, kv_transfer))
    return sse_response_ending_turns(answer.events(streams), headers, turn, cache)
