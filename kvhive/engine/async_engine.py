"""``AsyncEngine``: runs ``LLMEngine.step`` on one loop thread and routes each request's outputs
to its own asyncio queue."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

from kvhive.core.retention import RetentionSpec
from kvhive.engine.llm_engine import LLMEngine, RequestOutput
from kvhive.engine.request_errors import request_failure
from kvhive.engine.stats import EngineStats
from kvhive.request import FinishReason, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often the idle engine loop re-reads the engine's stats (the snapshot /metrics exports).
IDLE_STATS_REFRESH_S = 0.5



class QueuedRequest(NamedTuple):
    """A request ``generate`` queued for the loop thread, added to the engine before its next step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    session_id: str | None
    end_session: bool
    kv_transfer: Any
    retention: RetentionSpec | None
    priority: int

class AsyncEngine:
    """Runs ``LLMEngine.step`` on one loop thread; each request reads its own asyncio queue.

    The loop runs either on a background thread (``start``: tests, embedding) or on the caller's
    thread (``run``: ``kvhive serve`` runs it on the main thread and the HTTP server beside it,
    because oneDNN's linear layers run ~25% slower when called from a non-main thread here).

    Thread rule: the engine's scheduler, KV pool and requests (all that ``step`` changes) are
    touched only by the loop thread. Other threads enqueue commands (add, abort, end a session,
    ``call``) under ``_lock``; the loop thread applies them before each step. Besides those, other
    threads use only what ``LLMEngine`` documents as safe from any thread: the store tiers' pins and
    lookups (the tiers are thread-safe) and the facts fixed at construction. ``EngineClient`` is
    the server's whole view of the engine and keeps to this rule.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._pending_adds: list[QueuedRequest] = []
        self._pending_aborts: list[str] = []
        self._pending_session_ends: list[str] = []
        self._pending_calls: list[tuple[Callable[[LLMEngine], object], Future]] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()
        self.error: BaseException | None = None

    def start(self) -> None:
        """Start the background loop thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvhive-engine", daemon=True)
            self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until ``stop()`` or until the loop fails."""
        if self._thread is not None:
            raise RuntimeError("the engine loop already runs on a background thread")
        self._run()

    def stop(self) -> None:
        """Ask the loop to return after the current step; safe from a signal handler (no lock)."""
        self._stopping = True

    def shutdown(self) -> None:
        """Stop the loop after the current step and close the engine."""
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.engine.close()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step, or at most IDLE_STATS_REFRESH_S ago while idle."""
        return self._stats

    @property
    def is_healthy(self) -> bool:
        """False once the loop thread died of an exception."""
        return self.error is None

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       cache_salt: str | None = None, session_id: str | None = None,
                       end_session: bool = False, kv_transfer=None, retention: RetentionSpec | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early aborts it. Raises
        RequestFailed when computing it failed, RuntimeError when the engine loop has stopped."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.error}")
        if len(prompt_token_ids) >= self.engine.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                             f"is {self.engine.max_model_len} tokens")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._pending_adds.append(QueuedRequest(request_id, list(prompt_token_ids), sampling, cache_salt,
                                                    session_id, end_session, kv_transfer, retention, priority))
            self._wakeup.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item}") from item
                if item.finish_reason is FinishReason.ERROR:
                    finished = True             # the engine has ended it: nothing to abort
                    error = item.error or "the engine failed this request"
                    raise request_failure(error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Ask the loop thread to abort a request (safe from any thread)."""
        with self._lock:
            self._pending_aborts.append(request_id)
            self._wakeup.notify()

    def end_session(self, session_id: str) -> None:
        """Ask the loop thread to free a session's held blocks (safe from any thread)."""
        with self._lock:
            self._pending_session_ends.append(session_id)
            self._wakeup.notify()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run on the loop thread between steps; its result or its exception.
        RuntimeError when the loop has stopped (or stops before running it)."""
        future: Future = Future()
        with self._lock:
            if self.error is not None or self._stopping:
                raise RuntimeError("the engine loop has stopped")
            self._pending_calls.append((fn, future))
            self._wakeup.notify()
        return await asyncio.wrap_future(future)

    def _apply_commands(self) -> None:
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            ends, self._pending_session_ends = self._pending_session_ends, []
            calls, self._pending_calls = self._pending_calls, []
        for add in adds:
            request_id = add.request_id
            try:
                self.engine.add_request(request_id, add.prompt_token_ids, add.sampling, cache_salt=add.cache_salt,
                                        session_id=add.session_id, end_session=add.end_session,
                                        kv_transfer=add.kv_transfer, retention=add.retention,
                                        priority=add.priority)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                self._deliver(request_id, exc)
        for request_id in aborts:
            self.engine.abort_request(request_id)
        for session_id in ends:
            self.engine.end_session(session_id)
        for fn, future in calls:
            if not future.set_running_or_notify_cancel():
                continue                            # its caller gave up waiting
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _fail_pending_calls(self) -> None:
        """Fail the calls the loop will never run (it stopped or died)."""
        with self._lock:
            calls, self._pending_calls = self._pending_calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine loop has stopped"))

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _has_work(self) -> bool:
        # Lock held.
        return bool(self._pending_adds or self._pending_aborts or self._pending_session_ends
                    or self._pending_calls or self.engine.has_unfinished())

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._stopping and not self._has_work():
                        self._wakeup.wait(timeout=IDLE_STATS_REFRESH_S)      # stop() does not notify
                    if self._stopping:
                        return
                    idle = not self._has_work()
                if idle:
                    # Store writers finish saves and tiers evict between steps: /metrics stays current.
                    self._stats = self.engine.stats()
                    self.engine.keep_history()
                    continue
                self._apply_commands()
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
                self.engine.keep_history()
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop failed")
            self.error = exc
            with self._lock:
                targets = list(self._queues)
            for request_id in targets:
                self._deliver(request_id, exc)
        finally:
            self._fail_pending_calls()
