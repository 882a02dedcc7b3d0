"""What completions and chat share: checks, sampling, the engine stream as text, usage, SSE framing.

A request's text comes from ``GenerationService.stream``: engine outputs go through the incremental
detokenizer and the stop-string matcher; the stream aborts the engine request when it stops early
(stop string, client gone, error) and records the request's metrics exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvhive.core.tenancy import cache_salt, key_owner
from kvhive.core.tokenizer import IncrementalDetokenizer
from kvhive.engine.core import RequestFailed
from kvhive.engine.step import TokenLogprobs
from kvhive.request import SamplingParams
from kvhive.server.errors import APIError, bad_request, server_error
from kvhive.server.logprobs import SentToken, TokensAwaitingText
from kvhive.server.metrics import ServerMetrics
from kvhive.server.protocol import PromptTokensDetails, SamplingRequest, Usage
from kvhive.server.stop import StopStringMatcher
from kvhive.sessions.registry import Session, SessionError, SessionRegistry, check_session_id

if TYPE_CHECKING:
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.engine.async_engine import AsyncEngine
    from kvhive.engine.core import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a non-streamed request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.1
# Most choices (``n``) one request may ask for: each is an engine request of its own.
MAX_CHOICES = 16
# How long a request on a busy session waits for the running turn to end before its 409 (covers
# a client's own abort that the server has not processed yet), and how often it looks.
SESSION_BUSY_WAIT_S = 0.15
SESSION_BUSY_POLL_S = 0.005
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

    def usage(self) -> Usage:
        """OpenAI usage as of this delta."""
        return combined_usage([self])


def sse_event(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


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


def session_api_error(exc: SessionError) -> APIError:
    """A registry refusal as an OpenAI-shaped error."""
    kind = "rate_limit_error" if exc.status_code == 429 else "invalid_request_error"
    return APIError(exc.status_code, exc.message, type=kind, param=exc.param, code=exc.code)


async def wait_until_idle(session: Session, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the session's running turn to end; True once it has."""
    deadline = time.monotonic() + timeout_s
    while session.busy and time.monotonic() < deadline:
        await asyncio.sleep(SESSION_BUSY_POLL_S)
    return not session.busy


def pin_session_blocks(engine: LLMEngine, session: Session) -> None:
    """Pin the blocks the session holds now in the engine's store tiers (replacing its older pins)."""
    engine.pin_session(session.engine_id, [bytes.fromhex(h) for h in session.block_hashes])


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body iterator and calls ``on_close`` however sending
    ends: done, failed or cancelled (the client gone).

    Starlette neither closes a body iterator it stopped reading (its ``finally`` then waits for
    garbage collection) nor starts one when the client is gone before the first byte (its
    ``finally`` never runs); both leave a session busy unless closed here.
    """

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the response; then close the body and call ``on_close``, shielded from cancellation."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            self.on_close()


class GenerationService:
    """The server's view of the engine: validates what the engine would reject, streams text back."""

    def __init__(self, async_engine: AsyncEngine, metrics: ServerMetrics, served_model_name: str,
                 sessions: SessionRegistry | None = None, api_keys: tuple[str, ...] = (),
                 share_prefix_cache: bool = False) -> None:
        self.engine = async_engine
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.sessions = sessions
        self.has_api_keys = bool(api_keys)
        self.share_prefix_cache = share_prefix_cache
        self.tokenizer: Tokenizer = async_engine.engine.tokenizer
        self.max_model_len: int = async_engine.engine.max_model_len
        self.vocab_size: int = async_engine.engine.model_config.vocab_size

    # ------------------------------------------------------------ checks

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model."""
        if model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. Served model: "
                                f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def check_common(self, body: SamplingRequest) -> None:
        """400 for sampling fields kvhive does not implement, instead of silently ignoring them."""
        self.check_model(body.model)
        if not 1 <= body.n <= MAX_CHOICES:
            raise bad_request(f"'n' must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) != 0:
                raise bad_request(f"'{name}' is not supported; leave it unset or 0", param=name)
        if body.logit_bias:
            raise bad_request("'logit_bias' is not supported", param="logit_bias")
        self.check_token_ids(body.stop_token_ids or [], "stop_token_ids")

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        """400 if any id is outside the vocabulary."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} in '{param}' is outside the vocabulary "
                              f"[0, {self.vocab_size})", param=param)

    def resolve_max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str,
                           prompt_param: str) -> int:
        """The request's max_tokens: as asked (checked against the context), else all room left."""
        limit = self.max_model_len
        if requested is not None and requested < 1:
            raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param)
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please shorten "
                f"the prompt.", param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                f"for the completion). Please reduce the prompt or '{param}'.",
                param=param, code="context_length_exceeded")
        return requested

    @staticmethod
    def sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Engine sampling parameters from the request (OpenAI defaults: temperature 1, top_p 1);
        ``logprobs``: how many top alternatives to report per token (None: no logprobs);
        ``prompt_logprobs``: the same for the prompt's tokens. The body's fields are within their
        bounds (``SamplingRequest``); a temperature or top_p below ``SAMPLING_EPS`` samples greedily."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(0, body.top_k or 0),
                seed=body.seed,
                ignore_eos=body.ignore_eos,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    # ------------------------------------------------------------ tokenization

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat messages through the chat template; long ones rendered and tokenized
        off the event loop. Raises what the template raises (TemplateError, ValueError)."""
        if sum(len(m["content"]) for m in messages) < OFF_LOOP_CHARS:
            return self.tokenizer.encode_chat(messages)
        return await asyncio.to_thread(self.tokenizer.encode_chat, messages)

    # ------------------------------------------------------------ owners and sessions

    def owner_of(self, raw_request: Request) -> str | None:
        """A digest of the caller's API key (None without API keys): owns sessions, salts the cache."""
        if not self.has_api_keys:
            return None
        return key_owner(raw_request.headers.get("authorization", ""))

    def cache_salt_for(self, owner: str | None, body_salt: str | None) -> str | None:
        """The prefix-cache salt (``kvhive.core.tenancy.cache_salt``, which the gateway calls too)."""
        return cache_salt(owner, body_salt, self.share_prefix_cache)

    async def open_session(self, raw_request: Request, model: str, num_tokens: int, *,
                           conversation_id: str | None = None, new_ttl: int | None = None,
                           n: int = 1) -> Session | None:
        """The session this request runs in, marked busy: a new one (``new_ttl``), the one named by
        ``x-session-id`` or ``conversation_id`` (an unknown conversation_id starts one with the
        default TTL), or None. ``num_tokens`` (prompt + max output) is checked against the limits.
        A request of ``n`` > 1 choices cannot run in a session (400, before any session is touched).

        A session busy with another turn is waited for up to SESSION_BUSY_WAIT_S before the 409: a
        client that aborts a stream and sends its next turn at once may reach the server before
        the server has processed its disconnect (which ends the aborted turn)."""
        registry = self.sessions
        header = raw_request.headers.get("x-session-id")
        if header:
            try:
                check_session_id(header, "x-session-id")
            except SessionError as exc:
                raise session_api_error(exc) from None
        session_id = header or conversation_id
        if n > 1 and (session_id or new_ttl is not None):
            raise bad_request(f"'n' must be 1 in a session (x-session-id, conversation_id or POST "
                              f"/v1/context): a session holds one continuation, got n={n}", param="n")
        if registry is None or (new_ttl is None and not session_id):
            return None
        owner = self.owner_of(raw_request)
        try:
            if new_ttl is not None:
                registry.check_pinned(owner, num_tokens)
                return registry.create(owner, model, new_ttl)
            try:
                session = await registry.aget(session_id, owner)
            except SessionError:
                if raw_request.headers.get("x-session-id") or conversation_id is None:
                    raise
                registry.check_pinned(owner, num_tokens)
                return registry.create(owner, model, registry.config.default_ttl_s, session_id=conversation_id)
            if session.busy and await wait_until_idle(session, SESSION_BUSY_WAIT_S):
                session = await registry.aget(session_id, owner)     # as it is after that turn
            registry.begin_turn(session, model, num_tokens)
            return session
        except SessionError as exc:
            raise session_api_error(exc) from None

    # ------------------------------------------------------------ generation

    async def stream(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop_strings: Sequence[str], cache_salt: str | None, session: Session | None = None,
                     end_session: bool = False) -> AsyncIterator[TextDelta]:
        """Run one request; yield text deltas, the last with its finish reason.

        Leaving early (client gone, cancellation) or an engine error aborts the engine request; a
        request whose own computation failed raises ``RequestFailed`` (the route's 500).
        With a (busy) session the request continues it and, when it ends, the session holds
        prompt + output with its expiry slid; ``end_session`` deletes the session after the turn.
        """
        tracker = self.metrics.track_request()
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=True)
        matcher = StopStringMatcher(stop_strings)
        awaiting = TokensAwaitingText() if sampling.logprobs is not None else None
        num_sent = 0                  # characters of text yielded so far
        kwargs = {} if session is None else {"session_id": session.engine_id, "end_session": end_session}
        turn = 0 if session is None else session.turn
        outputs = self.engine.generate(request_id, prompt_token_ids, sampling, cache_salt=cache_salt, **kwargs)
        session_done = False
        counts = (len(prompt_token_ids), 0, 0)
        prompt_logprobs = None          # until the first delta carries them
        done = False
        try:
            async for out in outputs:
                counts = (out.num_prompt_tokens, max(0, out.num_cached_tokens), out.num_output_tokens)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                if session is not None and out.session_block_hashes is not None:
                    self._end_session_turn(session, turn, end_session, out.num_prompt_tokens + out.num_output_tokens,
                                           [h.hex() for h in out.session_block_hashes], counts[1])
                    session_done = True
                tracker.on_tokens(len(out.new_token_ids))
                delta = detokenizer.add(out.new_token_ids)
                if out.finished:
                    delta += detokenizer.flush()
                if awaiting is not None:
                    awaiting.add(out.logprobs or (), delta)
                text = matcher.feed(delta)
                num_sent += len(text)
                if matcher.stopped:
                    reason = "stop"
                    if not out.finished:
                        self.engine.abort(request_id)    # else the engine goes on to max_tokens
                    # Logprobs of the tokens whose text, or part of it, went out before the stop string.
                    tokens = () if awaiting is None else awaiting.release(num_sent)
                elif out.finished:
                    reason = out.finish_reason.value if out.finish_reason else "stop"
                    text += matcher.flush()
                    tokens = () if awaiting is None else awaiting.release_all()
                else:
                    if text:
                        tokens = () if awaiting is None else awaiting.release(num_sent)
                        yield TextDelta(text, None, *counts, tokens, prompt_logprobs)
                        prompt_logprobs = None
                    continue
                done = True
                tracker.finish(reason, counts[0], counts[2])
                await outputs.aclose()
                yield TextDelta(text, reason, *counts, tokens, prompt_logprobs)
                return
            raise RuntimeError(f"engine stream of {request_id} ended without a finished output")
        except RequestFailed:
            done = True                   # the engine ended it (its own row failed); others run on
            tracker.finish("error", counts[0], counts[2])
            raise
        finally:
            if not done:
                self.engine.abort(request_id)
                tracker.finish("abort", counts[0], counts[2])
            await outputs.aclose()
            if session is not None and not session_done:
                # Stopped early or failed: the engine keeps what was computed; slide the expiry.
                self._end_session_turn(session, turn, end_session, None, None)

    def _end_session_turn(self, session: Session, turn: int, end_session: bool, num_tokens: int | None,
                          block_hashes: list[str] | None, cached_tokens: int = 0) -> None:
        """End turn ``turn`` of the session, once: a later call for it (or for an older turn) does nothing."""
        assert self.sessions is not None
        if not session.busy or session.turn != turn:
            return
        if end_session:
            self.sessions.delete(session)
            self.free_session_kv(session)
        else:
            self.sessions.end_turn(session, num_tokens, block_hashes, cached_tokens)
            if block_hashes is not None:
                self.pin_session_kv(session)

    def pin_session_kv(self, session: Session) -> None:
        """Pin the blocks the session holds now in the store tiers (replacing its older pins)."""
        pin_session_blocks(self.engine.engine, session)

    def free_session_kv(self, session: Session) -> None:
        """Release an expired or deleted session's blocks: on the device and its store pins."""
        self.engine.end_session(session.engine_id)
        self.engine.engine.unpin_session(session.engine_id)

    def choice_streams(self, request_id: str, n: int, prompt_token_ids: list[int], sampling: SamplingParams,
                       stop_strings: Sequence[str], cache_salt: str | None, session: Session | None = None,
                       end_session: bool = False) -> list[AsyncIterator[TextDelta]]:
        """One ``stream`` per choice. n == 1: the engine request is ``request_id`` itself. n > 1:
        engine requests ``{request_id}-{i}``, each with its own seed (``choice_seed``), never in a
        session; they run concurrently, and the scheduler computes the prompt's full blocks once
        (the other choices wait a step and hit them)."""
        if n == 1:
            return [self.stream(request_id, prompt_token_ids, sampling, stop_strings, cache_salt,
                                session=session, end_session=end_session)]
        assert session is None, "open_session refuses n > 1 in a session"
        streams = []
        for i in range(n):
            seeded = replace(sampling, seed=choice_seed(sampling.seed, i))
            streams.append(self.stream(f"{request_id}-{i}", prompt_token_ids, seeded, stop_strings, cache_salt))
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
            last: list[TextDelta | None] = [None] * len(streams)
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                async for index, delta in merged:
                    parts[index].append(delta.text)
                    tokens[index].extend(delta.tokens)
                    if delta.prompt_logprobs is not None:
                        prompt[index] = delta.prompt_logprobs
                    last[index] = delta
            joined = []
            for texts, sent, final, prompt_logprobs in zip(parts, tokens, last, prompt, strict=True):
                assert final is not None
                joined.append(TextDelta("".join(texts), final.finish_reason, final.num_prompt_tokens,
                                        final.num_cached_tokens, final.num_output_tokens, tuple(sent),
                                        prompt_logprobs))
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

    @staticmethod
    def _result(task: asyncio.Task[list[TextDelta]]) -> list[TextDelta]:
        try:
            return task.result()
        except APIError:
            raise
        except Exception as exc:
            logger.exception("engine error")
            raise server_error(f"Engine error: {type(exc).__name__}: {exc}") from exc

    def sse_response(self, events: AsyncIterator[str], headers: dict[str, str], session: Session | None,
                     end_session: bool = False) -> StreamingResponse:
        """The SSE response over ``events``; a session turn ends even if the stream never started."""
        body = self.sse_with_errors(events)
        headers = {**SSE_HEADERS, **headers}
        if session is None:
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        turn = session.turn

        def end_unstarted_turn() -> None:
            # A no-op when the stream ended the turn itself (the usual case).
            self._end_session_turn(session, turn, end_session, None, None)

        return ClosingStreamingResponse(body, end_unstarted_turn, media_type="text/event-stream", headers=headers)

    async def sse_with_errors(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pass SSE events through; an engine error after the headers went out becomes an error event."""
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    yield event
            except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
                logger.exception("engine error while streaming")
                yield sse_event(server_error(f"Engine error: {type(exc).__name__}: {exc}").body())
                yield SSE_DONE
