"""The engine: the one place where the scheduler and the runner meet.

``LLMEngine`` is synchronous: ``step()`` asks the scheduler for a ``StepPlan``, hands it to the
runner, and feeds the ``StepResult`` back. Beside it: ``async_engine.py`` (``AsyncEngine`` runs
``step()`` on one loop thread), ``client.py`` (the server's narrow view of it), ``stats.py`` (the
stats snapshot types), ``assembly.py`` (how its parts are built from the config), ``holdings.py``
(what the store tiers hold for it: session pins, block counts by tier).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhive.config import EngineConfig
from kvhive.core.retention import RetentionSpec
from kvhive.engine import assembly, warm_start
from kvhive.engine.cache_reset import CacheReset, reset_caches
from kvhive.engine.holdings import TierHoldings
from kvhive.engine.request_errors import RequestFailed  # noqa: F401 - this module's public name too
from kvhive.engine.stats import ConnectorCounters, EngineStats, TierBudget
from kvhive.engine.step import StepPlan, StepResult, TokenLogprobs
from kvhive.kv.window_group import fit_kv_budget
from kvhive.request import FinishReason, Request, SamplingParams
from kvhive.structured import GrammarCompiler

if TYPE_CHECKING:
    from kvhive.store.tiered import TieredStore

logger = logging.getLogger(__name__)

# Steps in a row whose forward may raise before the engine gives up (the step raises, and the
# AsyncEngine loop stops): each failed step fails only its own requests, but a model that fails
# every step is broken, and the process should exit for a supervisor to restart it.
MAX_FAILED_STEPS_IN_ROW = 3


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # Set on the last output of a session's request: the block hashes the session now holds.
    session_block_hashes: tuple[bytes, ...] | None = None
    # For a request with a retention (its prompt-cache pins): the hashes of its full blocks so far,
    # on its first output after the prompt was computed and on its last.
    block_hashes: tuple[bytes, ...] | None = None
    # One entry per new token when the request's sampling params ask for logprobs, else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # On the request's first output when it asks for prompt_logprobs: one entry per prompt token
    # after the first (token i scored given tokens < i), else None.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # With finish_reason ERROR: what failed while computing this request (the others ran on).
    error: str | None = None
    # When (time.monotonic) the engine queued the request, first scheduled it (None: not yet) and
    # produced this output: the server's queue, prefill and decode times come from these.
    queued_time: float = 0.0
    scheduled_time: float | None = None
    output_time: float = 0.0


class LLMEngine:
    """Loads a model and tokenizer, and runs scheduler steps through the model runner."""

    def __init__(self, config: EngineConfig, loaded=None, tokenizer=None, store: TieredStore | None = None) -> None:
        """``store``: the KV tiers below the device pool, built by the caller from ``config.store``
        (``kvhive.launch``) or any others; without it the engine opens those ``config.store``
        describes. The engine closes them."""
        self.isa = assembly.kernel_isa(config)
        if loaded is None:
            loaded = assembly.load_model(config, self.isa)
        assembly.fix_quant_rows(config, loaded.model)
        if tokenizer is None:
            tokenizer = assembly.load_tokenizer(config)
        self.tokenizer = tokenizer
        # From here on the config's model-dependent values (pool size, context length) are fixed.
        # Disaggregated serving sends whole pool blocks: it keeps every layer in one pool.
        config = fit_kv_budget(config, loaded.config, one_pool=config.kv_transfer.disaggregated)
        self.config = config = config.resolved(loaded.config, external_store=store is not None)
        self.model_config = loaded.config
        self.fingerprint = loaded.fingerprint
        self.max_model_len = config.scheduler.max_model_len
        self.num_blocks = config.cache.num_blocks
        self.block_bytes = config.kv_bytes_per_block(loaded.config)
        self._connect(config, loaded, assembly.tiers_for(config, store))
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) or loaded.config.eos_token_ids
        # Structured outputs: each distinct spec compiled once for this vocabulary (kvhive.structured).
        self.grammars = GrammarCompiler(tokenizer, loaded.config.vocab_size, self.eos_token_ids,
                                        cache_size=config.grammar_cache_size)
        self.runner = assembly.build_runner(config, loaded, self.num_blocks, self.worker_half, self.isa,
                                            self.grammars)
        self.paths = {**loaded.model.paths(), **self.runner.paths()}
        logger.info("paths: %s", "; ".join(f"{op} {path}" for op, path in self.paths.items()))
        self.threads = assembly.thread_governor(config)
        # Prompt logprobs of requests that asked, gathered chunk by chunk until their first output.
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        # Requests queued and not scheduled yet: the step that first schedules one stamps it.
        self._unscheduled: dict[str, Request] = {}
        self.num_failed_steps_in_row = 0
        self._session_copy = assembly.session_copy(self.store, self.connector_scheduler, self.connector_worker)
        self.scheduler = assembly.build_scheduler(config, loaded, self.num_blocks, self.scheduler_half,
                                                  self._session_copy, self.runner.window)
        self._history = assembly.load_history(config, self.scheduler, self.fingerprint, loaded.config.vocab_size)
        self.publisher = None
        events = config.kv_events_settings()
        if events is not None and events.active:
            self.publisher = assembly.open_publisher(events, config, self.scheduler, self.store,
                                                     self.connector_scheduler)

    def _connect(self, config: EngineConfig, loaded, store: TieredStore | None) -> None:
        """Set up the offload connector over ``store`` (none without tiers) and, for ``--kv-role``,
        the disaggregation halves around it: the halves the scheduler and the runner use."""
        self.store, self.connector_scheduler, self.connector_worker = store, None, None
        if store is not None:
            connector = assembly.build_connector(config, loaded, store, self.block_bytes)
            self.connector_scheduler, self.connector_worker = connector.scheduler_half, connector.worker_half
        self.holdings = TierHoldings(store, None if store is None else self.connector_scheduler.key_space)
        self.scheduler_half, self.worker_half = self.connector_scheduler, self.connector_worker
        self.disagg = None
        if config.kv_transfer.disaggregated:
            self.disagg = assembly.build_disagg(config, loaded, self.connector_scheduler, self.connector_worker,
                                                store, lambda hashes: self.scheduler.count_cached_blocks(hashes))
            self.scheduler_half, self.worker_half = self.disagg

    def runtime_info(self) -> dict:
        """What this engine runs on and which implementation each op takes (``GET /version``)."""
        cpu_line = None
        if self.isa is not None:
            from kvhive.model import cpu

            cpu_line = cpu.detect().describe()
        return {"device": self.config.device, "dtype": self.config.dtype,
                "kv_cache_dtype": self.config.kv_dtype, "cpu": cpu_line,
                "cpu_isa": self.isa, "paths": dict(self.paths)}

    def count_device_blocks(self, block_hashes) -> int:
        """How many of these blocks the device prefix cache holds; loop thread only (it reads the pool)."""
        return self.scheduler.count_cached_blocks(block_hashes)

    def count_tier_blocks(self, block_hashes) -> dict[str, int]:
        """How many of these blocks each store tier holds, by tier name ({} without tiers or blocks).

        Safe from any thread (touches only the store tiers, which are thread-safe).
        """
        return self.holdings.count_tier_blocks(block_hashes)

    def keeper_budget(self) -> TierBudget | None:
        """The tier that keeps pinned session blocks and its byte budget; None without store tiers
        or when that tier has no budget of its own (Redis: its own memory limit applies). Any thread."""
        return self.holdings.keeper_budget()

    def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Drop the cached blocks nobody holds (``reset_external``: also the local store tiers'
        unpinned ones) and restate what is held on the KV-event stream; loop thread only."""
        key_prefix = b"" if self.store is None else self.connector_scheduler.key_space.prefix
        return reset_caches(self.scheduler, self.store, key_prefix, self.publisher,
                            self.config.cache.block_size, reset_external)

    def end_session(self, session_id: str) -> None:
        """Free the blocks a session holds (loop thread only); its store pins go with ``unpin_session``."""
        self.scheduler.end_session(session_id)

    def fork_session(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Share the parent session's held full blocks of its first ``num_tokens`` tokens with the
        child session (loop thread only); the tokens shared (``SessionHoldings.fork``)."""
        return self.scheduler.kv.sessions.fork(parent_id, child_id, num_tokens)

    def pin_session(self, session_id: str, block_hashes) -> None:
        """Keep these blocks of a live session in the store tiers until ``unpin_session``.

        Replaces the session's previous pins; without store tiers nothing to do (the device pool
        then keeps session blocks itself). Safe from any thread (touches only the store's pin table).
        With a network tier (Redis) the pins are applied on a helper thread, in call order, so the
        caller (the HTTP event loop) never waits on the network.
        """
        self.holdings.pin_session(session_id, block_hashes)

    def unpin_session(self, session_id: str) -> None:
        """Let the store tiers evict the session's blocks (those no other session pins); any thread."""
        self.holdings.unpin_session(session_id)

    def pinned_blocks_by_tier(self) -> dict[str, int]:
        """How many of the distinct blocks live sessions pin each store tier holds; any thread.

        A network tier (Redis) is asked on a helper thread, waited for at most
        NETWORK_STATS_WAIT_S (then its previous answer stands); while it is down it holds 0."""
        return self.holdings.pinned_blocks_by_tier()

    def warm_up(self) -> None:
        """Run a few forward passes on blocks nothing holds yet, before the first request
        (``kvhive.engine.warm_start``); call it once, right after the engine is built."""
        started = time.perf_counter()
        if warm_start.warm_up(self.runner, self.model_config.vocab_size):
            logger.info("warm-up forward passes in %.2f s", time.perf_counter() - started)

    def keep_history(self) -> None:
        """Start writing the speculative history to the disk cache dir if it kept new sequences and
        its last write is old enough (``speculative.history_file.HistoryKeeper``); the loop thread, after a step
        or while idle. Cheap when nothing is due."""
        if self._history is not None:
            self._history.tick()

    def close(self) -> None:
        """Keep the speculative history (with a disk cache dir), flush and close the KV-event
        publisher, finish KV saves and close the store tiers."""
        if self._history is not None:
            self._history.close()
        self.runner.close()
        self.holdings.close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()
        if self.disagg is not None:
            self.disagg.worker.close()
            self.disagg = None
        if self.connector_worker is not None:
            self.connector_worker.close()
            self.connector_worker = None
        if self.store is not None:
            self.store.close()
            self.store = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    cache_salt: str | None = None, session_id: str | None = None,
                    end_session: bool = False, kv_transfer=None, retention: RetentionSpec | None = None,
                    priority: int = 0) -> None:
        """Queue a request; the caller has checked its length against max_model_len.

        With ``session_id`` the request continues that session's held blocks and, when it ends,
        leaves its own blocks to the session (``end_session``: frees them instead).
        ``kv_transfer`` (a KVTransferParams): its part in a disaggregated prefill/decode transfer.
        ``retention``: how firmly its blocks stay cached once freed; ``priority``: its admission
        order under ``--scheduling-policy priority``.
        """
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                             f"is {self.max_model_len} tokens")
        if sampling.prompt_logprobs is not None and session_id is not None:
            raise ValueError("prompt logprobs cannot be asked in a session: the session's tokens "
                             "are not computed again")
        if priority and not self.config.scheduler.by_priority:
            raise ValueError(f"priority {priority} needs --scheduling-policy priority (the policy is fcfs)")
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          sampling=sampling, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
                          session_id=session_id, end_session=end_session, kv_transfer=kv_transfer,
                          retention=retention, priority=priority)
        self.scheduler.add_request(request)
        self._unscheduled[request_id] = request
        if sampling.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = []

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown ids are ignored."""
        self._prompt_logprobs.pop(request_id, None)
        self._unscheduled.pop(request_id, None)
        self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step through the model; return what each touched request produced."""
        started = time.perf_counter()
        if self.threads is not None:
            self.threads.adjust()
        if self.worker_half is not None:
            finished = self.worker_half.get_finished(())
            if finished.done_recving or finished.done_sending:
                self.scheduler.finish_kv_transfers(finished)
        plan = self.scheduler.schedule()
        if self._unscheduled:
            self._note_scheduled(plan)
        if plan.is_empty and plan.connector_meta is None:
            if self.worker_half is not None and self.scheduler.has_unfinished():
                time.sleep(0.001)     # only transfers in flight: do not spin on the loop thread
            # schedule() may have finished requests itself (too long for the pool): report them.
            if plan.finished_request_ids:
                self.runner.release(plan.finished_request_ids)
            result = StepResult(sampled={})
        else:
            try:
                result = self.runner.execute(plan)
            except Exception as exc:
                self.num_failed_steps_in_row += 1
                if self.num_failed_steps_in_row >= MAX_FAILED_STEPS_IN_ROW:
                    raise
                logger.exception("step failed (%d in a row); failing its %d requests",
                                 self.num_failed_steps_in_row, len(plan.seqs))
                return self._fail_step(plan, f"{type(exc).__name__}: {exc}")
            self.num_failed_steps_in_row = 0
        for request_id, values in result.prompt_logprobs.items():
            if request_id in self._prompt_logprobs:     # else aborted since: nobody reads them
                self._prompt_logprobs[request_id].extend(values)
        now = time.monotonic()
        # Drafted steps may emit several tokens, cut at a stop: counted from the plan's output count.
        drafted = {s.request_id: s.num_output_tokens for s in plan.seqs if s.draft_token_ids}
        outputs = [self._output(req, result, now, drafted_from=drafted.get(req.request_id))
                   for req in self.scheduler.update_from_result(plan, result)]
        self._publish_events()
        # The whole step, planning and outputs too: what a token more or less in a step costs.
        self.scheduler.observe_step(plan, time.perf_counter() - started)
        if self.threads is not None and not self.scheduler.has_unfinished():
            self.threads.idle()
        return outputs

    def _note_scheduled(self, plan: StepPlan) -> None:
        """Stamp the requests ``plan`` runs for the first time: their time in the queue ends now."""
        now = time.monotonic()
        for seq in plan.seqs:
            req = self._unscheduled.pop(seq.request_id, None)
            if req is not None:
                req.scheduled_time = now

    def _output(self, req: Request, result: StepResult, now: float, error: str | None = None,
                drafted_from: int | None = None) -> RequestOutput:
        """What the step ``result`` produced for ``req`` at ``now`` (``error``: why it failed, if it
        did; ``drafted_from``: its output tokens before a drafted step, else None)."""
        token = result.sampled.get(req.request_id)
        num_kept = None if drafted_from is None else req.num_output_tokens - drafted_from
        new_ids, logprobs = result.emitted(req.request_id, num_kept)
        prompt = self._prompt_logprobs.pop(req.request_id, None)
        if req.is_finished:
            self._unscheduled.pop(req.request_id, None)     # ended before it ever ran (too long)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids,
            finished=req.is_finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            session_block_hashes=(tuple(req.block_hashes) if req.session_id and req.is_finished
                                  else None),
            block_hashes=(tuple(req.block_hashes) if req.retention is not None and (
                req.is_finished or (token is not None and req.num_output_tokens == 1)) else None),
            logprobs=logprobs,
            prompt_logprobs=None if prompt is None else tuple(prompt),
            error=error or result.failed.get(req.request_id),
            queued_time=req.arrival_time, scheduled_time=req.scheduled_time, output_time=now)

    def _fail_step(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        """The outputs of a step whose forward raised: each of its requests finished with ERROR
        (nothing the step computed becomes a prefix-cache hit), then those ``schedule`` finished."""
        empty, now = StepResult(sampled={}), time.monotonic()
        outputs = []
        for seq in plan.seqs:
            req = self.scheduler.abort_request(seq.request_id, FinishReason.ERROR)
            if req is not None:
                outputs.append(self._output(req, empty, now, f"the step computing it failed: {error}"))
        outputs += [self._output(req, empty, now) for req in self.scheduler.update_from_result(plan, empty)]
        self._publish_events()
        return outputs

    def _publish_events(self) -> None:
        if self.publisher is not None:
            events = self.scheduler.kv.take_events()
            if events:
                self.publisher.publish(events)

    def stats(self) -> EngineStats:
        """Scheduler and pool counters for the metrics endpoint."""
        s = self.scheduler.stats()
        pool = s.kv.blocks
        tiers, connector = (), None
        if self.connector_scheduler is not None and self.connector_worker is not None:
            tiers = self.connector_scheduler.tier_stats()
            c, w = self.connector_scheduler.stats(), self.connector_worker
            connector = ConnectorCounters(c.sync_loads, c.async_loads, w.failed_load_blocks, c.saved_blocks,
                                          w.dropped_save_blocks, w.async_load_seconds, w.async_load_count,
                                          c.unsaved_low_priority)
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_usage=s.kv_usage,
                           prefix_cache_queries_tokens=s.prefix_cache_queries_tokens,
                           prefix_cache_hits_tokens=s.prefix_cache_hits_tokens,
                           num_preemptions=s.num_preemptions, num_blocks=self.num_blocks,
                           block_size=self.config.cache.block_size, tiers=tiers, connector=connector,
                           num_session_blocks=s.num_session_blocks, num_session_spills=s.num_session_spills,
                           free_blocks=pool.num_free - pool.num_evictable, cached_blocks=pool.num_evictable,
                           used_blocks=pool.num_used, window_pool=s.kv.window,
                           kv_transfer=None if self.disagg is None else self.disagg.worker.stats(),
                           spec_decode=self.scheduler.spec_decode_stats())
