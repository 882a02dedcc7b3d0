"""What completions and chat share: checks, sampling, the engine stream as text, usage.

A request's text comes from ``GenerationService.stream``: engine outputs go through the incremental
detokenizer and the stop-string matcher; the stream aborts the engine request when it stops early
(stop string, client gone, error) and records the request's metrics exactly once. A request in a
session runs as a ``SessionTurn`` that ``kvhive.sessions.service`` opens and the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from kvhive.core.generation_defaults import NO_DEFAULTS, SamplingDefaults
from kvhive.core.structured_spec import StructuredSpec
from kvhive.core.tenancy import cache_salt, key_owner
from kvhive.core.tokenizer import IncrementalDetokenizer
from kvhive.engine.llm_engine import RequestFailed, RequestOutput
from kvhive.engine.step import TokenLogprobs
from kvhive.request import SamplingParams
from kvhive.server.errors import APIError, bad_request, server_error
from kvhive.server.logprobs import SentToken, TokensAwaitingText
from kvhive.server.metrics import ServerMetrics
from kvhive.server.prompt_cache import NO_PROMPT_CACHE, PromptCache, open_prompt_cache
from kvhive.server.protocol import PromptTokensDetails, SamplingRequest, Usage
from kvhive.server.request_checks import check_stream_options
from kvhive.server.sampling_fields import sampling_params_for
from kvhive.server.sse import sse_response
from kvhive.server.stop import StopStringMatcher
from kvhive.sessions.registry import SessionError, check_session_id
from kvhive.sessions.service import NO_TURN, SessionService, SessionTurn

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.engine.client import EngineClient
    from kvhive.server.responses_protocol import ResponsesRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a non-streamed request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.1
# Most choices (``n``) one request may ask for: each is an engine request of its own.
MAX_CHOICES = 16
# Prompts of this many characters or more are tokenized (chat: rendered and tokenized) on a worker
# thread, so the event loop goes on serving (/health, other streams) meanwhile.
OFF_LOOP_CHARS = 4096


def new_request_id(prefix: str) -> str:
    """A fresh response id, also used as the engine request id (unique per request)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    """``created`` field value."""
    return int(time.time())


@dataclass(frozen=True)
class TextDelta:
    """Text produced since the previous delta; ``finish_reason`` is set on the last one."""

    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # The tokens whose text is in this delta, when the request asked for logprobs.
    tokens: tuple[SentToken, ...] = ()
    # On the first delta of a request that asked for prompt logprobs: the prompt tokens' after the
    # first (``RequestOutput.prompt_logprobs``).
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # The ids the engine generated since the previous delta (``return_token_ids``).
    token_ids: tuple[int, ...] = ()
    # On the last delta of a request with a retention: its full blocks' hashes, as far as the
    # engine reported them (``RequestOutput.block_hashes``); None otherwise.
    block_hashes: tuple[bytes, ...] | None = None

    def usage(self) -> Usage:
        """OpenAI usage as of this delta."""
        return combined_usage([self])


def session_headers(turn: SessionTurn) -> dict[str, str]:
    """The response headers that name the request's session (``x-session-id``); none outside one."""
    return {} if turn.session is None else {"x-session-id": turn.session.session_id}


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: choice 0 keeps the request's (so n=1 samples as before), the
    others get distinct seeds derived from it, the same on every repeat of the request."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1          # non-negative, below 2**63


def combined_usage(finals: Sequence[TextDelta]) -> Usage:
    """Usage of a request's choices (their last deltas): the prompt counted once, with the cached
    tokens the first choice found; completion tokens summed over the choices."""
    first = finals[0]
    completion = sum(d.num_output_tokens for d in finals)
    return Usage(prompt_tokens=first.num_prompt_tokens, completion_tokens=completion,
                 total_tokens=first.num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens))


@dataclass(frozen=True)
class TextOptions:
    """How a request's tokens become its text (vLLM's fields): special tokens dropped or written out,
    a matched stop string kept at the end of the text or cut."""

    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def of(cls, body: SamplingRequest) -> TextOptions:
        """The options a completion or chat request asks for."""
        return cls(body.skip_special_tokens, body.include_stop_str_in_output)


@dataclass(frozen=True)
class _StreamEnded:
    """What ``merge_streams``' pump sends when its stream ends: nothing, or the error it raised."""

    error: Exception | None


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each with its stream's index.

    A stream that fails fails the merge; leaving the merge early (or failing) closes every stream.
    One stream is passed through directly (no task, no queue).
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | _StreamEnded] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(_StreamEnded(exc))
            return
        queue.put_nowait(_StreamEnded(None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            event = await queue.get()
            if isinstance(event, _StreamEnded):
                if event.error is not None:
                    raise event.error
                running -= 1
                continue
            yield event
    finally:
        for task in tasks:
            task.cancel()              # closes its stream, which aborts its engine request
        await asyncio.gather(*tasks, return_exceptions=True)


class DeltaAssembler:
    """Turns one request's engine outputs into ``TextDelta``s: incremental detokenization, stop
    strings (looked for once more than ``min_tokens`` tokens were generated, as vLLM does), the
    logprobs of the tokens whose text went out, the prompt logprobs on the first delta."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop_strings: Sequence[str],
                 with_logprobs: bool, text: TextOptions = TextOptions(), min_tokens: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                   skip_special_tokens=text.skip_special_tokens)
        self._matcher = StopStringMatcher(stop_strings, include_stop=text.include_stop_str_in_output)
        self._min_tokens = min_tokens
        self._awaiting = TokensAwaitingText() if with_logprobs else None
        self._num_sent = 0                            # characters of text handed out so far
        self._prompt_logprobs: tuple[TokenLogprobs, ...] | None = None   # until a delta carries them
        self._new_ids: list[int] = []                 # generated since the previous delta
        # Token counts as of the latest output: prompt, cached (never negative), output.
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = len(prompt_token_ids), 0, 0

    def add(self, out: RequestOutput) -> TextDelta | None:
        """The delta of one engine output: the last one (its finish reason set) once a stop string
        matched or the engine finished the request; None while no new text is ready to send."""
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = max(0, out.num_cached_tokens)
        self.num_output_tokens = out.num_output_tokens
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        self._new_ids.extend(out.new_token_ids)
        text = self._new_text(out)
        if self._matcher.stopped:
            # Logprobs of the tokens whose text, or part of it, went out before the stop string.
            return self._delta(text, "stop", self._release(self._num_sent))
        if out.finished:
            text += self._matcher.flush()
            reason = out.finish_reason.value if out.finish_reason else "stop"
            return self._delta(text, reason, () if self._awaiting is None else self._awaiting.release_all())
        if not text:
            return None
        return self._delta(text, None, self._release(self._num_sent))

    def _new_text(self, out: RequestOutput) -> str:
        """The output's new text up to any stop string (held back while it may start one)."""
        text = self._detokenizer.add(out.new_token_ids)
        if out.finished:
            text += self._detokenizer.flush()
        if self._awaiting is not None:
            self._awaiting.add(out.logprobs or (), text)
        sent = text if out.num_output_tokens <= self._min_tokens else self._matcher.feed(text)
        self._num_sent += len(sent)
        return sent

    def _release(self, num_chars: int) -> tuple[SentToken, ...]:
        """The tokens whose text is within the first ``num_chars`` characters sent (none without logprobs)."""
        return () if self._awaiting is None else self._awaiting.release(num_chars)

    def _delta(self, text: str, reason: str | None, tokens: tuple[SentToken, ...]) -> TextDelta:
        """A delta with the current counts; the prompt logprobs go with the first one only."""
        delta = TextDelta(text, reason, self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens,
                          tokens, self._prompt_logprobs, tuple(self._new_ids))
        self._prompt_logprobs = None
        self._new_ids.clear()
        return delta


class GenerationService:
    """Validates what the engine would reject and streams a request's text back, over the
    ``EngineClient``; a request's session turn comes from the ``SessionService``."""

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
                          **variables: Any) -> list[int]:
        """Token ids of chat messages through the chat template (``variables``: its ``tools``;
        ``template_kwargs``: the request's ``chat_template_kwargs``); long ones rendered and
        tokenized off the event loop. Raises what the template raises (TemplateError, ValueError)."""
        kwargs = {**(template_kwargs or {}), **variables}
        size = sum(len(m.get("content") or "") for m in messages) + len(str(variables.get("tools") or ""))
        if size < OFF_LOOP_CHARS:
            return self.tokenizer.encode_chat(messages, **kwargs)
        return await asyncio.to_thread(functools.partial(self.tokenizer.encode_chat, messages, **kwargs))

    # ------------------------------------------------------------ owners and sessions

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

    async def open_session(self, raw_request: Request, model: str, num_tokens: int, *,
                           conversation_id: str | None = None, new_ttl: int | None = None,
                           end_session: bool = False, n: int = 1, wait_if_busy: bool = True,
                           turn_number: int | None = None) -> SessionTurn:
        """The session turn this request runs in (``SessionService.open_turn``): a new session
        (``new_ttl``), the one named by ``x-session-id`` or ``conversation_id``, or ``NO_TURN``.
        ``num_tokens`` is prompt + max output. A request of ``n`` > 1 choices cannot run in a
        session (400, before any session is touched); nor can a ``turn_number`` outside one.
        ``turn_number``: 409 unless it is the session's next turn (``check_turn_number``)."""
        header = raw_request.headers.get("x-session-id")
        if header:
            check_session_id(header, "x-session-id")
        if turn_number is not None and not (header or conversation_id or new_ttl is not None):
            raise bad_request("'turn_number' counts the turns of a session: send it with x-session-id, "
                              "conversation_id or POST /v1/context", param="turn_number")
        if n > 1 and (header or conversation_id or new_ttl is not None):
            raise bad_request(f"'n' must be 1 in a session (x-session-id, conversation_id or POST "
                              f"/v1/context): a session holds one continuation, got n={n}", param="n")
        return await self.sessions.open_turn(self.owner_of(raw_request), model, num_tokens, session_id=header or None,
                                             conversation_id=conversation_id, new_ttl=new_ttl,
                                             end_session=end_session, wait_if_busy=wait_if_busy,
                                             turn_number=turn_number)

    # ------------------------------------------------------------ generation

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop_strings: Sequence[str], cache_salt: str | None,
                     turn: SessionTurn = NO_TURN, kv_transfer=None, text: TextOptions = TextOptions(),
                     cache: PromptCache = NO_PROMPT_CACHE, *, priority: int = 0) -> AsyncIterator[TextDelta]:
        """Run one request; yield text deltas, the last with its finish reason.

        Leaving early (client gone, cancellation) or an engine error aborts the engine request; a
        request whose own computation failed raises ``RequestFailed`` (the route's 500).
        The request runs in ``turn``'s session, and ends the turn: with what the session holds
        once the engine says so, else (stopped early, failed) with what it held before. It runs
        with ``cache``'s retention and ends its pins' turn before its last delta goes out (then
        ``cache.pins.usage`` holds the counters), with the prompt's block hashes once the engine
        computed the prompt.
        """
        tracker = self.metrics.track_request(sampling.max_tokens)
        deltas = DeltaAssembler(self.tokenizer, prompt_token_ids, stop_strings, sampling.logprobs is not None,
                                text, sampling.min_tokens)
        outputs = self.engine.generate(request_id, prompt_token_ids, sampling, cache_salt=cache_salt,
                                       session_id=turn.engine_id, end_session=turn.end_session,
                                       kv_transfer=kv_transfer, retention=cache.engine_retention,
                                       priority=priority)
        done = False
        block_hashes: Sequence[bytes] | None = None          # the request's full blocks, once reported
        try:
            async for out in outputs:
                if out.session_block_hashes is not None:
                    turn.end(out.num_prompt_tokens + out.num_output_tokens, out.session_block_hashes,
                             max(0, out.num_cached_tokens))
                if out.block_hashes is not None:
                    block_hashes = out.block_hashes
                tracker.on_output(out)
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
            # Stopped early or failed: the engine keeps what was computed; the expiry slides.
            # A no-op when the turn ended above.
            turn.end()
            cache.end(block_hashes, deltas.num_cached_tokens)

    def choice_streams(self, request_id: str, n: int, prompt_token_ids: list[int], sampling: SamplingParams,
                       stop_strings: Sequence[str], cache_salt: str | None,
                       turn: SessionTurn = NO_TURN, kv_transfer=None, text: TextOptions = TextOptions(),
                       cache: PromptCache = NO_PROMPT_CACHE, *, priority: int = 0) -> list[AsyncIterator[TextDelta]]:
        """One ``stream`` per choice. n == 1: the engine request is ``request_id`` itself. n > 1:
        engine requests ``{request_id}-{i}``, each with its own seed (``choice_seed``), never in a
        session; they run concurrently, and the scheduler computes the prompt's full blocks once
        (the other choices wait a step and hit them). Every choice runs with ``cache``'s
        retention; the first ends its pins."""
        if n == 1:
            return [self.stream(request_id, prompt_token_ids, sampling, stop_strings, cache_salt, turn,
                                kv_transfer, text, cache, priority=priority)]
        assert turn is NO_TURN, "open_session refuses n > 1 in a session"
        streams = []
        for i in range(n):
            seeded = replace(sampling, seed=choice_seed(sampling.seed, i))
            streams.append(self.stream(f"{request_id}-{i}", prompt_token_ids, seeded, stop_strings, cache_salt,
                                       text=text, cache=cache if i == 0 else cache.without_pins(), priority=priority))
        return streams

    async def collect(self, deltas: AsyncIterator[TextDelta], raw_request: Request) -> TextDelta | None:
        """Join a whole stream into one delta; None if the client went away (the request is aborted)."""
        joined = await self.collect_choices([deltas], raw_request)
        return None if joined is None else joined[0]

    async def collect_choices(self, streams: Sequence[AsyncIterator[TextDelta]], raw_request: Request
                              ) -> list[TextDelta] | None:
        """Join each choice's stream into one delta (all run concurrently); None if the client went
        away (then every choice's engine request is aborted)."""

        async def join() -> list[TextDelta]:
            parts: list[list[str]] = [[] for _ in streams]
            tokens: list[list[SentToken]] = [[] for _ in streams]
            prompt: list[tuple[TokenLogprobs, ...] | None] = [None] * len(streams)
            ids: list[list[int]] = [[] for _ in streams]
            last: list[TextDelta | None] = [None] * len(streams)
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, delta in merged:
                    parts[index].append(delta.text)
                    tokens[index].extend(delta.tokens)
                    ids[index].extend(delta.token_ids)
                    if delta.prompt_logprobs is not None:
                        prompt[index] = delta.prompt_logprobs
                    last[index] = delta
            joined = []
            for texts, sent, final, prompt_logprobs, generated in zip(parts, tokens, last, prompt, ids, strict=True):
                assert final is not None
                joined.append(TextDelta("".join(texts), final.finish_reason, final.num_prompt_tokens,
                                        final.num_cached_tokens, final.num_output_tokens, tuple(sent),
                                        prompt_logprobs, tuple(generated), final.block_hashes))
            return joined

        task = asyncio.create_task(join())
        try:
            while True:
                finished, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if finished:
                    return self._result(task)
                if await raw_request.is_disconnected():
                    logger.info("client disconnected; aborting %s", raw_request.url.path)
                    return None
        finally:
            if not task.done():
                task.cancel()      # closes the streams, which aborts the engine requests
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def whole_answer(self, streams: Sequence[AsyncIterator[TextDelta]], raw_request: Request,
                           headers: dict[str, str], answer: Callable[[list[TextDelta]], BaseModel]
                           ) -> Response | BaseModel:
        """The non-streamed answer: the choices joined (``collect_choices``) and made a response by
        ``answer``, as a JSONResponse carrying ``headers`` when there are any; 499 if the client left."""
        results = await self.collect_choices(streams, raw_request)
        if results is None:
            return Response(status_code=499)          # the client is gone; nobody reads this
        body = answer(results)
        return JSONResponse(body.model_dump(mode="json"), headers=headers) if headers else body

    @staticmethod
    def _result(task: asyncio.Task[list[TextDelta]]) -> list[TextDelta]:
        try:
            return task.result()
        except (APIError, SessionError):
            raise                                     # answered with its own status
        except Exception as exc:
            logger.exception("engine error")
            raise server_error(f"Engine error: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def sse_response(events: AsyncIterator[str], headers: dict[str, str], turn: SessionTurn = NO_TURN,
                     cache: PromptCache = NO_PROMPT_CACHE) -> StreamingResponse:
        """The SSE response over ``events``; a session's turn and the pins' turn end even if the
        stream never started (a no-op when the stream ended them, the usual case)."""
        if cache.pins is None:
            return sse_response(events, headers, None if turn is NO_TURN else turn.end)

        def end_turns() -> None:
            turn.end()
            cache.end(None, 0)
        return sse_response(events, headers, end_turns)

    async def open_cache(self, raw_request: Request, body: SamplingRequest | ResponsesRequest,
                         token_ids: Sequence[int], cache_salt: str | None) -> PromptCache:
        """The request's ``PromptCache`` from its prompt-cache fields (``kvhive.server.prompt_cache``)."""
        return await open_prompt_cache(self, raw_request, body.model, token_ids, cache_salt,
                                       retention_config=body.kv_cache_retention_config,
                                       prompt_cache_retention=getattr(body, "prompt_cache_retention", None))

    async def open_session_after(self, cache: PromptCache, raw_request: Request, model: str, num_tokens: int,
                                 **session: Any) -> SessionTurn:
        """``open_session`` for a request whose pins are open: a refusal ends the pins' turn (the
        pins it would have created are dropped) before it is raised."""
        try:
            return await self.open_session(raw_request, model, num_tokens, **session)
        except BaseException:
            cache.end(None, 0)
            raise
