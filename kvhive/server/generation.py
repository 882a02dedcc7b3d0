"""The generation service the routes share: checks of what the engine would reject, sampling
parameters, chat tokenization, the caller's owner and cache salt, and ``GenerationService.stream``.

A request's text comes from ``GenerationService.stream``: engine outputs go through the
``DeltaAssembler`` (``kvhive.server.text_deltas``); the stream aborts the engine request when it
stops early (stop string, client gone, error) and records the request's metrics exactly once. A
request in a session runs as a ``SessionTurn`` that ``kvhive.server.session_turns`` opens and the
stream ends; its choices (``n``) fan out in ``kvhive.server.choices``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel

from kvhive.core.generation_defaults import NO_DEFAULTS, SamplingDefaults
from kvhive.core.structured_spec import StructuredSpec
from kvhive.core.tenancy import cache_salt, key_owner
from kvhive.engine.llm_engine import RequestFailed, RequestOutput
from kvhive.request import SamplingParams
from kvhive.server.choices import MAX_CHOICES
from kvhive.server.errors import APIError, bad_request
from kvhive.server.metrics import RequestMetrics, ServerMetrics
from kvhive.server.prompt_cache import NO_PROMPT_CACHE, PromptCache, open_prompt_cache
from kvhive.server.protocol import SamplingRequest
from kvhive.server.request_checks import check_stream_options
from kvhive.server.sampling_fields import sampling_params_for
from kvhive.server.text_deltas import PLAIN_TEXT, DeltaAssembler, TextDelta, TextOptions
from kvhive.sessions.service import NO_TURN, SessionService, SessionTurn

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.engine.client import EngineClient
    from kvhive.server.responses_protocol import ResponsesRequest


# Prompts of this many characters or more are tokenized (chat: rendered and tokenized) on a worker
# thread, so the event loop goes on serving (/health, other streams) meanwhile.
OFF_LOOP_CHARS = 4096


class GenerationService:
    """Validates what the engine would reject and streams a request's text back, over the
    ``EngineClient``; a request's session turn comes from the ``SessionService``
    (``kvhive.server.session_turns.open_session``)."""

    def __init__(self, engine: EngineClient, metrics: ServerMetrics, served_model_name: str,
                 sessions: SessionService, api_keys: tuple[str, ...] = (),
                 share_prefix_cache: bool = False, defaults: SamplingDefaults = NO_DEFAULTS,
                 tool_call_parser: str = "auto") -> None:
        """``defaults``: what a request that leaves a sampling field unset gets (``--generation-config``)."""
        self.engine = engine
        self.defaults = defaults
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.sessions = sessions
        self.has_api_keys = bool(api_keys)
        self.share_prefix_cache = share_prefix_cache
        self.tool_call_parser = tool_call_parser     # --tool-call-parser: "auto" or a parser's name
        self.tokenizer: Tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size

    # ------------------------------------------------------------ checks

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model."""
        if model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. Served model: "
                                f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def check_common(self, body: SamplingRequest) -> None:
        """400 for a model not served, ``n`` out of bounds or a stop token outside the vocabulary."""
        self.check_model(body.model)
        if not 1 <= body.n <= MAX_CHOICES:
            raise bad_request(f"'n' must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        check_stream_options(body)
        self.check_priority(body.priority)

    def check_priority(self, priority: int) -> None:
        """400 for a scheduling ``priority`` other than 0 unless ``--scheduling-policy priority``
        (vLLM's rule: never ignored)."""
        if priority and not self.engine.config.scheduler.by_priority:
            raise bad_request(f"'priority' {priority} needs the server to run with --scheduling-policy "
                              f"priority (it runs fcfs): leave it out or 0", param="priority")

    def kv_transfer_params(self, body: SamplingRequest):
        """The body's ``kv_transfer_params`` for this instance's ``--kv-role`` (a KVTransferParams,
        or None); 400 naming the bad key."""
        from kvhive.connector.disagg.params import KVTransferParamsError, parse_kv_transfer_params

        try:
            params = parse_kv_transfer_params(body.kv_transfer_params, self.engine.config.kv_transfer.role)
        except KVTransferParamsError as exc:
            raise bad_request(str(exc), param=f"kv_transfer_params.{exc.field}".removesuffix(
                ".kv_transfer_params")) from None
        if params is not None and body.n != 1:
            raise bad_request("kv_transfer_params needs n == 1", param="n")
        return params

    @staticmethod
    def check_transfer_unconstrained(structured: StructuredSpec | None, kv_transfer) -> None:
        """400 for a constrained output split between a prefill and a decode instance: the decode
        instance's grammar would start after the token the prefill sampled."""
        if structured is not None and kv_transfer is not None:
            raise bad_request(f"'{structured.source}' (a constrained output) cannot be combined with "
                              f"kv_transfer_params: send the request to one instance", param="kv_transfer_params")

    @staticmethod
    def with_kv_transfer(answer: Callable[[list[TextDelta]], BaseModel], params
                         ) -> Callable[[list[TextDelta]], BaseModel]:
        """``answer``, whose response to a prefill request carries the decode request's params."""
        if params is None or not params.do_remote_decode:
            return answer

        def with_params(results: list[TextDelta]) -> BaseModel:
            response = answer(results)
            response.kv_transfer_params = params.for_decode()
            return response
        return with_params

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """400 if any id is outside the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} in '{param}' is outside the vocabulary "
                              f"[0, {self.vocab_size})", param=param)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str,
                           prompt_param: str) -> int:
        """The request's max_tokens: as asked (checked against the context), else all room left (at
        most the model's ``max_new_tokens`` default, ``--generation-config``)."""
        limit = self.max_model_len
        if requested is not None and requested < 1:
            raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param)
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please shorten "
                f"the prompt.", param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return min(limit - num_prompt_tokens, self.defaults.max_tokens or limit)
        if num_prompt_tokens + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                f"for the completion). Please reduce the prompt or '{param}'.",
                param=param, code="context_length_exceeded")
        return requested

    def sampling_params(self, body: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None, structured: StructuredSpec | None = None
                        ) -> SamplingParams:
        """Engine sampling parameters from the request, unset fields from the model's defaults, then
        OpenAI's (``kvhive.server.sampling_fields.sampling_params_for``); ``logprobs``: how many top
        alternatives to report per token (None: no logprobs); ``prompt_logprobs``: the same for the
        prompt's tokens; ``structured``: the constraint the output decodes under
        (``kvhive.server.structured``)."""
        return sampling_params_for(body, max_tokens, self.defaults, self.vocab_size, logprobs, prompt_logprobs,
                                   structured)

    # ------------------------------------------------------------ tokenization

    async def encode_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                          add_generation_prompt: bool = True, continue_final_message: bool = False,
                          **variables: Any) -> list[int]:
        """Token ids of chat messages through the chat template (``variables``: its ``tools``;
        ``template_kwargs``: the request's ``chat_template_kwargs``; the two flags as
        ``Tokenizer.apply_chat_template`` takes them); long ones rendered and tokenized off the
        event loop. Raises what the template raises (TemplateError, ValueError)."""
        encode = functools.partial(self.tokenizer.encode_chat, messages, add_generation_prompt, continue_final_message,
                                   **(template_kwargs or {}), **variables)
        size = sum(len(m.get("content") or "") for m in messages) + len(str(variables.get("tools") or ""))
        return encode() if size < OFF_LOOP_CHARS else await asyncio.to_thread(encode)

    # ------------------------------------------------------------ owners

    def owner_of(self, raw_request: Request) -> str | None:
        """A digest of the caller's API key (``Authorization: Bearer`` or ``x-api-key``; None
        without API keys): owns sessions, salts the cache."""
        if not self.has_api_keys:
            return None
        headers = raw_request.headers
        return key_owner(headers.get("authorization"), headers.get("x-api-key"))

    def cache_salt_for(self, owner: str | None, body_salt: str | None) -> str | None:
        """The prefix-cache salt (``kvhive.core.tenancy.cache_salt``, which the gateway calls too)."""
        return cache_salt(owner, body_salt, self.share_prefix_cache)

    # ------------------------------------------------------------ generation

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop_strings: Sequence[str], cache_salt: str | None,
                     turn: SessionTurn = NO_TURN, kv_transfer=None, text: TextOptions = PLAIN_TEXT,
                     cache: PromptCache = NO_PROMPT_CACHE, *, priority: int = 0) -> AsyncIterator[TextDelta]:
        """Run one request; yield text deltas, the last with its finish reason.

        Leaving early (client gone, cancellation) or an engine error aborts the engine request; a
        request whose own computation failed raises ``RequestFailed`` (the route's 500). The request
        runs in ``turn``'s session, and ends the turn: with what the session holds once the engine
        says so, else (stopped early, failed) with what it held before. It runs with ``cache``'s
        retention and ends its pins' turn before its last delta goes out (then ``cache.pins.usage``
        holds the counters), with the prompt's block hashes once the engine computed the prompt.
        """
        tracker = self.metrics.track_request(sampling.max_tokens)
        deltas = DeltaAssembler(self.tokenizer, prompt_token_ids, stop_strings, sampling.logprobs is not None,
                                text, sampling.min_tokens)
        outputs = self._engine_outputs(request_id, prompt_token_ids, sampling, cache_salt, turn, kv_transfer,
                                       cache, priority)
        done = False
        block_hashes: Sequence[bytes] | None = None          # the request's full blocks, once reported
        try:
            async for out in outputs:
                self._note_output(out, turn, tracker)
                block_hashes = block_hashes if out.block_hashes is None else out.block_hashes
                delta = deltas.add(out)
                if delta is None:
                    continue
                if delta.finish_reason is None:
                    yield delta
                    continue
                if not out.finished:
                    self.engine.abort(request_id)    # a stop string: else the engine goes on to max_tokens
                cache.end(block_hashes, delta.num_cached_tokens)
                done = True
                tracker.finish(delta.finish_reason, delta.num_prompt_tokens, delta.num_output_tokens)
                await outputs.aclose()
                yield delta if block_hashes is None else replace(delta, block_hashes=tuple(block_hashes))
                return
            raise RuntimeError(f"engine stream of {request_id} ended without a finished output")
        except RequestFailed:
            done = True                   # the engine ended it (its own row failed); others run on
            tracker.finish("error", deltas.num_prompt_tokens, deltas.num_output_tokens)
            raise
        finally:
            if not done:
                self.engine.abort(request_id)
                tracker.finish("abort", deltas.num_prompt_tokens, deltas.num_output_tokens)
            await outputs.aclose()
            turn.end()          # stopped early or failed: with what it held, the expiry slides (else a no-op)
            cache.end(block_hashes, deltas.num_cached_tokens)

    def _engine_outputs(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                        cache_salt: str | None, turn: SessionTurn, kv_transfer, cache: PromptCache,
                        priority: int) -> AsyncIterator[RequestOutput]:
        """The engine's outputs of one request, run in ``turn``'s session with ``cache``'s retention."""
        return self.engine.generate(request_id, prompt_token_ids, sampling, cache_salt=cache_salt,
                                    session_id=turn.engine_id, end_session=turn.end_session,
                                    kv_transfer=kv_transfer, retention=cache.engine_retention,
                                    priority=priority)

    @staticmethod
    def _note_output(out: RequestOutput, turn: SessionTurn, tracker: RequestMetrics) -> None:
        """Record one engine output: the turn ends with what the session holds once the engine says
        so; the request's metrics count the output."""
        if out.session_block_hashes is not None:
            turn.end(out.num_prompt_tokens + out.num_output_tokens, out.session_block_hashes,
                     max(0, out.num_cached_tokens))
        tracker.on_output(out)

    async def open_cache(self, raw_request: Request, body: SamplingRequest | ResponsesRequest,
                         token_ids: Sequence[int], cache_salt: str | None) -> PromptCache:
        """The request's ``PromptCache`` from its prompt-cache fields (``kvhive.server.prompt_cache``)."""
        return await open_prompt_cache(self, raw_request, body.model, token_ids, cache_salt,
                                       retention_config=body.kv_cache_retention_config,
                                       prompt_cache_retention=getattr(body, "prompt_cache_retention", None))

