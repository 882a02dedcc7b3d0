"""A request's choices (``n``): one engine stream per choice, each with its own seed, merged as
their deltas come (streamed answers) or joined into one delta each (whole answers), aborted
together when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvhive.engine.request_errors import ConstraintRefused
from kvhive.engine.step import TokenLogprobs
from kvhive.request import SamplingParams
from kvhive.server.errors import APIError, constraint_error, server_error
from kvhive.server.logprobs import SentToken
from kvhive.server.prompt_cache import NO_PROMPT_CACHE, PromptCache
from kvhive.server.text_deltas import PLAIN_TEXT, TextDelta, TextOptions
from kvhive.sessions.registry import SessionError
from kvhive.sessions.service import NO_TURN, SessionTurn

if TYPE_CHECKING:
    from kvhive.server.generation import GenerationService

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Most choices (``n``) one request may ask for: each is an engine request of its own.
MAX_CHOICES = 16
# How often a non-streamed request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: choice 0 keeps the request's (so n=1 samples as before), the
    others get distinct seeds derived from it, the same on every repeat of the request."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1          # non-negative, below 2**63


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


def choice_streams(service: GenerationService, request_id: str, n: int, prompt_token_ids: list[int],
                   sampling: SamplingParams, stop_strings: Sequence[str], cache_salt: str | None,
                   turn: SessionTurn = NO_TURN, kv_transfer=None, text: TextOptions = PLAIN_TEXT,
                   cache: PromptCache = NO_PROMPT_CACHE, *, priority: int = 0) -> list[AsyncIterator[TextDelta]]:
    """One ``stream`` per choice. n == 1: the engine request is ``request_id`` itself. n > 1:
    engine requests ``{request_id}-{i}``, each with its own seed (``choice_seed``), never in a
    session; they run concurrently, and the scheduler computes the prompt's full blocks once
    (the other choices wait a step and hit them). Every choice runs with ``cache``'s
    retention; the first ends its pins."""
    if n == 1:
        return [service.stream(request_id, prompt_token_ids, sampling, stop_strings, cache_salt, turn,
                               kv_transfer, text, cache, priority=priority)]
    assert turn is NO_TURN, "open_session refuses n > 1 in a session"
    streams = []
    for i in range(n):
        seeded = replace(sampling, seed=choice_seed(sampling.seed, i))
        streams.append(service.stream(f"{request_id}-{i}", prompt_token_ids, seeded, stop_strings, cache_salt,
                                      text=text, cache=cache if i == 0 else cache.without_pins(),
                                      priority=priority))
    return streams


async def collect(deltas: AsyncIterator[TextDelta], raw_request: Request) -> TextDelta | None:
    """Join a whole stream into one delta; None if the client went away (the request is aborted)."""
    joined = await collect_choices([deltas], raw_request)
    return None if joined is None else joined[0]


async def collect_choices(streams: Sequence[AsyncIterator[TextDelta]], raw_request: Request
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
                return _joined_result(task)
            if await raw_request.is_disconnected():
                logger.info("client disconnected; aborting %s", raw_request.url.path)
                return None
    finally:
        if not task.done():
            task.cancel()      # closes the streams, which aborts the engine requests
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def whole_answer(streams: Sequence[AsyncIterator[TextDelta]], raw_request: Request,
                       headers: dict[str, str], answer: Callable[[list[TextDelta]], BaseModel]
                       ) -> Response | BaseModel:
    """The non-streamed answer: the choices joined (``collect_choices``) and made a response by
    ``answer``, as a JSONResponse carrying ``headers`` when there are any; 499 if the client left."""
    results = await collect_choices(streams, raw_request)
    if results is None:
        return Response(status_code=499)          # the client is gone; nobody reads this
    body = answer(results)
    return JSONResponse(body.model_dump(mode="json"), headers=headers) if headers else body


def _joined_result(task: asyncio.Task[list[TextDelta]]) -> list[TextDelta]:
    """The joined choices; an engine error becomes a 500, a constraint no token can continue a 400
    (API and session errors keep their status)."""
    try:
        return task.result()
    except (APIError, SessionError):
        raise                                     # answered with its own status
    except ConstraintRefused as exc:
        raise constraint_error(exc) from exc      # the client's constraint: a 400
    except Exception as exc:
        logger.exception("engine error")
        raise server_error(f"Engine error: {type(exc).__name__}: {exc}") from exc

