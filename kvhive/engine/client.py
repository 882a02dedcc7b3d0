"""``EngineClient``: the server's whole view of the engine, a handful of thread-safe calls.

The server never holds the ``LLMEngine`` itself. Each method here keeps to ``AsyncEngine``'s
thread rule, and says which way it does:

- queued for the loop thread: ``generate`` (submit), ``abort``, ``reset_prefix_cache``,
  ``fork_session``, the device half of ``release_session`` and of ``session_blocks_by_tier``
  (``AsyncEngine.call``);
- store tiers only (thread-safe by their own contract): ``hold_session``, the store half of
  ``release_session`` and ``session_blocks_by_tier``, ``pinned_blocks_by_tier``, ``keeper_budget``,
  ``copy_to_shared_tier`` (blocking: a worker thread's call);
- a worker thread: ``check_structured`` (compiles a structured-output spec, thread-safe cache);
- snapshots and facts fixed at construction: ``stats``, ``is_healthy``, ``runtime_info``, and
  the attributes (tokenizer, context length, block geometry, fingerprint, config).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kvhive.core.retention import RetentionSpec
from kvhive.engine.cache_reset import CacheReset
from kvhive.engine.llm_engine import RequestOutput
from kvhive.engine.stats import EngineStats, TierBudget
from kvhive.request import SamplingParams
from kvhive.store.shared_copy import SharedCopy, copy_to_shared_tier
from kvhive.structured import StructuredOutputError

if TYPE_CHECKING:
    from kvhive.config import EngineConfig
    from kvhive.core.structured_spec import StructuredSpec
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.engine.async_engine import AsyncEngine


__all__ = ["EngineClient", "StructuredOutputError"]


class EngineClient:
    """Submit and abort requests, read stats, hold and release a session's blocks, count blocks per tier."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self._async = async_engine
        engine = async_engine.engine
        self._engine = engine
        # Facts fixed at construction: any thread.
        self.config: EngineConfig = engine.config
        self.tokenizer: Tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.block_size: int = engine.config.cache.block_size
        self.block_bytes: int = engine.block_bytes
        self.fingerprint: str = engine.fingerprint

    # ------------------------------------------------------------ requests

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 cache_salt: str | None = None, session_id: str | None = None,
                 end_session: bool = False, kv_transfer=None, retention: RetentionSpec | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs (``AsyncEngine.generate``: leaving early aborts it)."""
        return self._async.generate(request_id, prompt_token_ids, sampling, cache_salt=cache_salt,
                                    session_id=session_id, end_session=end_session, kv_transfer=kv_transfer,
                                    retention=retention, priority=priority)

    async def check_structured(self, spec: StructuredSpec) -> None:
        """Compile ``spec`` for this model's vocabulary (cached per distinct spec, on a worker
        thread: the event loop never waits on it); raises StructuredOutputError, whose ``message``
        and ``param`` make the 400, when it cannot be served or its compile passes the time limit
        (``GrammarCompiler.time_limit_s``). Call it before ``generate``."""
        grammars = self._engine.grammars
        if grammars.cached(spec) is not None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(grammars.compile, spec), grammars.time_limit_s)
        except asyncio.TimeoutError:
            # The compile runs on and caches its refusal; this request is answered now.
            raise StructuredOutputError(f"compiling the {spec.kind} constraint takes more than "
                                        f"{grammars.time_limit_s:g} s", spec.source) from None

    def abort(self, request_id: str) -> None:
        """Stop a request (queued for the loop thread); unknown ids are ignored."""
        self._async.abort(request_id)

    # ------------------------------------------------------------ state

    def stats(self) -> EngineStats:
        """The engine's latest stats snapshot."""
        return self._async.stats()

    @property
    def is_healthy(self) -> bool:
        """False once the engine loop died."""
        return self._async.is_healthy

    def runtime_info(self) -> dict:
        """Device, dtype, CPU kernel level and each op's implementation (``GET /version``)."""
        return self._engine.runtime_info()

    async def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Drop the cached blocks nobody holds (``reset_external``: the local store tiers' too),
        on the loop thread between steps; what was dropped and what is still held."""
        return await self._async.call(lambda engine: engine.reset_prefix_cache(reset_external))

    # ------------------------------------------------------------ sessions

    def hold_session(self, session_id: str, block_hashes: Sequence[bytes]) -> None:
        """Pin these blocks of a live session in the store tiers, replacing its older pins."""
        self._engine.pin_session(session_id, list(block_hashes))

    def release_session(self, session_id: str) -> None:
        """Free an ended session's device blocks (on the loop thread) and drop its store pins."""
        self._async.end_session(session_id)
        self._engine.unpin_session(session_id)

    async def fork_session(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Give the child session its own holding of the parent's device blocks of its first
        ``num_tokens`` tokens (full blocks, shared copy-on-write), on the loop thread; the tokens shared."""
        return await self._async.call(lambda engine: engine.fork_session(parent_id, child_id, num_tokens))

    async def session_blocks_by_tier(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """How many of these blocks each level holds: "device", then each store tier by name. The
        device is counted on the loop thread, the store tiers on a worker thread."""
        hashes = list(block_hashes)
        device = await self._async.call(lambda engine: engine.count_device_blocks(hashes))
        tiers = await asyncio.to_thread(self._engine.count_tier_blocks, hashes)
        return {"device": device, **tiers}

    def pinned_blocks_by_tier(self) -> dict[str, int]:
        """How many of the distinct blocks live sessions pin each store tier holds."""
        return self._engine.pinned_blocks_by_tier()

    def copy_to_shared_tier(self, block_hashes: Sequence[bytes]) -> SharedCopy | None:
        """Wait for the queued KV saves, then copy these blocks the shared tier lacks into it from
        this process's own tiers; None without a shared tier. Blocking."""
        engine = self._engine
        if engine.store is None:
            return None
        engine.connector_worker.wait_for_save()
        return copy_to_shared_tier(engine.store, engine.connector_scheduler.key_space.keys(list(block_hashes)))

    def keeper_budget(self) -> TierBudget | None:
        """The store tier that keeps pinned session blocks and its budget; None without one."""
        return self._engine.keeper_budget()
