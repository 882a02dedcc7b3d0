"""The engine: the one place where the scheduler and the runner meet.

``LLMEngine`` is synchronous: ``step()`` asks the scheduler for a ``StepPlan``, hands it to the
runner, and feeds the ``StepResult`` back. Beside it: ``async_engine.py`` (``AsyncEngine`` runs
``step()`` on one loop thread), ``client.py`` (the server's narrow view of it), ``stats.py`` (the
stats snapshot types).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kvhive.config import EngineConfig
from kvhive.core.blocks import root_hash
from kvhive.engine.cache_reset import CacheReset, reset_caches
from kvhive.engine.scheduler import Scheduler, TierSessionCopy
from kvhive.engine.stats import ConnectorCounters, EngineStats, TierBudget
from kvhive.engine.step import StepPlan, StepResult, TokenLogprobs
from kvhive.kv.events_config import KVEventsConfig
from kvhive.kv.window_group import fit_kv_budget, window_layout_for
from kvhive.request import FinishReason, Request, SamplingParams

logger = logging.getLogger(__name__)

# Steps in a row whose forward may raise before the engine gives up (the step raises, and the
# AsyncEngine loop stops): each failed step fails only its own requests, but a model that fails
# every step is broken, and the process should exit for a supervisor to restart it.
MAX_FAILED_STEPS_IN_ROW = 3
# How long a metrics read waits for a network tier (Redis) before reusing its previous answer.
NETWORK_STATS_WAIT_S = 0.25


class RequestFailed(RuntimeError):
    """Computing one request failed (its row, or the step it ran in); the engine runs on."""


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


def _kernel_isa(config: EngineConfig) -> str | None:
    """The ISA level the CPU kernels run at (ValueError naming what the CPU lacks); None off the CPU."""
    if not config.on_cpu:
        return None
    from kvhive.model import cpu

    cpu.check_dtype(config.dtype, config.device)
    features = cpu.detect()
    isa = features.level(config.cpu_isa)
    logger.info("CPU: %s; kernels for %s%s", features.describe(), isa,
                "" if config.cpu_isa == "auto" else " (forced by --cpu-isa)")
    return isa


def _load_model(config: EngineConfig, isa: str | None):
    """The model ``config.model_path`` names, loaded for the config's dtype, device and kernels."""
    from kvhive.model.loader import load_model

    started = time.perf_counter()
    loaded = load_model(config.model_path, dtype=config.dtype, device=config.device,
                        quantized_matmul=config.quantized_matmul, isa=isa)
    logger.info("loaded %s (%s, %s) in %.1f s", os.path.basename(config.model_path.rstrip("/")),
                config.dtype, config.device, time.perf_counter() - started)
    return loaded


def _thread_governor(config: EngineConfig):
    """A ThreadGovernor sizing torch's thread team, with ``adaptive_threads`` on the CPU; else None."""
    if not (config.adaptive_threads and config.on_cpu):
        return None
    import torch

    from kvhive.model.threads import ThreadGovernor

    return ThreadGovernor(torch.get_num_threads(), torch.set_num_threads)


class LLMEngine:
    """Loads a model and tokenizer, and runs scheduler steps through the model runner."""

    def __init__(self, config: EngineConfig, loaded=None, tokenizer=None, store=None) -> None:
        """``store`` (a TieredStore) replaces the tiers ``config.store`` describes; the engine closes it."""
        self.isa = _kernel_isa(config)
        if loaded is None:
            loaded = _load_model(config, self.isa)
        if tokenizer is None:
            from kvhive.core.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_path(config.model_path)
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
        self.store = self.connector_scheduler = self.connector_worker = None
        self._network_stats: ThreadPoolExecutor | None = None    # asks a network tier for metrics
        self._network_stats_lock = threading.Lock()
        self._network_counts: dict[str, int] = {}               # its last answers, by tier name
        self._pin_thread: ThreadPoolExecutor | None = None       # applies pins with a network tier
        if config.store.enabled or store is not None:
            self._build_connector(loaded, store, self.block_bytes)
        # The halves the scheduler and the runner use: disaggregation's around the offload ones.
        self.scheduler_half, self.worker_half = self.connector_scheduler, self.connector_worker
        self.disagg = self._build_disagg(loaded) if config.kv_transfer.disaggregated else None
        self.runner = self._build_runner(loaded)
        self.paths = {**loaded.model.paths(), **self.runner.paths()}
        logger.info("paths: %s", "; ".join(f"{op} {path}" for op, path in self.paths.items()))
        self.threads = _thread_governor(config)
        # Prompt logprobs of requests that asked, gathered chunk by chunk until their first output.
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        # Requests queued and not scheduled yet: the step that first schedules one stamps it.
        self._unscheduled: dict[str, Request] = {}
        self.num_failed_steps_in_row = 0
        self.scheduler = self._build_scheduler(loaded)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) or loaded.config.eos_token_ids
        self.publisher = None
        events = config.kv_events_settings()
        if events is not None and events.active:
            self.publisher = self._open_publisher(events)

    def _open_publisher(self, events: KVEventsConfig):
        """The KV-event publisher: AllBlocksCleared first (the pool starts empty), then the blocks the
        store tiers hold and, from then on, the device pool's and the tiers' changes."""
        from kvhive.kv.events_config import open_publisher
        from kvhive.kv.tier_events import TierEventForwarder

        publisher = open_publisher(events, self.config.served_model_name)
        publisher.publish_cleared()
        self.scheduler.kv.enable_events()
        if self.store is not None:
            self.store.send_events_to(TierEventForwarder(publisher, self.config.cache.block_size),
                                      self.connector_scheduler.key_space.prefix)
        return publisher

    def _build_runner(self, loaded):
        """The model runner over a KV pool of ``num_blocks`` blocks (and the connector's worker half)."""
        from kvhive.engine.runner import ModelRunner

        config, started = self.config, time.perf_counter()
        runner = ModelRunner(loaded.model, loaded.config, num_blocks=self.num_blocks,
                             block_size=config.cache.block_size, dtype=config.dtype,
                             device=config.device, native_attention=config.native_attention,
                             connector=self.worker_half, cuda_graphs=not config.enforce_eager,
                             max_num_seqs=config.scheduler.max_num_seqs, isa=self.isa,
                             window=window_layout_for(loaded.config, config, config.kv_transfer.disaggregated))
        logger.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB %s on %s) in %.1f s", self.num_blocks,
                    config.cache.block_size, self.num_blocks * config.cache.block_size, runner.pool_bytes() / 2**30,
                    config.dtype, config.device, time.perf_counter() - started)
        return runner

    def _build_scheduler(self, loaded) -> Scheduler:
        """The scheduler over the device pool; with store tiers it spills sessions they hold copies of."""
        cache = self.config.cache
        self._session_copy = None
        if self.store is not None:
            self._session_copy = TierSessionCopy(self.store, self.connector_scheduler.key_space,
                                                 self.connector_worker.is_saving)
        return Scheduler(self.config.scheduler, cache, self.num_blocks,
                         root_hash(cache.hash_seed, loaded.fingerprint),
                         connector=self.scheduler_half, session_copy=self._session_copy,
                         window=self.runner.window)

    def _build_disagg(self, loaded):
        """Both disaggregation halves for ``--kv-role`` around the offload connector (or none)."""
        from kvhive.connector.disagg.build import build_disagg, leading_held
        from kvhive.connector.offload import KV_LAYOUT_VERSION
        from kvhive.store.key import KeySpace

        key_space = KeySpace(loaded.fingerprint, KV_LAYOUT_VERSION, self.config.dtype, self.config.cache.block_size)
        root = root_hash(self.config.cache.hash_seed, loaded.fingerprint)
        halves = build_disagg(self.config.kv_transfer, key_space, root, loaded.config.num_layers,
                              self.connector_scheduler, self.connector_worker, self.store,
                              lambda hashes: leading_held(self.scheduler.count_cached_blocks, hashes))
        self.scheduler_half, self.worker_half = halves
        return halves

    def runtime_info(self) -> dict:
        """What this engine runs on and which implementation each op takes (``GET /version``)."""
        cpu_line = None
        if self.isa is not None:
            from kvhive.model import cpu

            cpu_line = cpu.detect().describe()
        return {"device": self.config.device, "dtype": self.config.dtype, "cpu": cpu_line,
                "cpu_isa": self.isa, "paths": dict(self.paths)}

    def _build_connector(self, loaded, store, block_bytes: int) -> None:
        """The store tiers and both halves of the offload connector over them."""
        from kvhive.connector.offload import KV_LAYOUT_VERSION, OffloadScheduler
        from kvhive.connector.offload_worker import OffloadWorker
        from kvhive.sessions.durable import DurableState
        from kvhive.store.key import KeySpace

        started = time.perf_counter()
        if store is None:
            store = DurableState(self.config.store, self.config.served_model_name).tiered_store()
        self.store = store
        logger.info("KV tiers: %s opened in %.1f s", ", ".join(t.name for t in self.store.tiers),
                    time.perf_counter() - started)
        key_space = KeySpace(loaded.fingerprint, KV_LAYOUT_VERSION, self.config.dtype,
                             self.config.cache.block_size)
        self.connector_scheduler = OffloadScheduler(self.store, key_space, block_bytes)
        self.connector_worker = OffloadWorker(self.store)

    def count_device_blocks(self, block_hashes) -> int:
        """How many of these blocks the device prefix cache holds; loop thread only (it reads the pool)."""
        return self.scheduler.count_cached_blocks(block_hashes)

    def count_tier_blocks(self, block_hashes) -> dict[str, int]:
        """How many of these blocks each store tier holds, by tier name ({} without tiers or blocks).

        Safe from any thread (touches only the store tiers, which are thread-safe).
        """
        if self.store is None or not block_hashes:
            return {}
        return self.store.count_by_tier(self.connector_scheduler.key_space.keys(block_hashes))

    def keeper_budget(self) -> TierBudget | None:
        """The tier that keeps pinned session blocks and its byte budget; None without store tiers
        or when that tier has no budget of its own (Redis: its own memory limit applies). Any thread."""
        store = self.store
        if store is None:
            return None
        tier = store.tiers[store.keeper]
        budget = tier.store.stats().budget_bytes
        return None if budget is None else TierBudget(tier.name, budget)

    def reset_prefix_cache(self, reset_external: bool = False) -> CacheReset:
        """Drop the cached blocks nobody holds (``reset_external``: also the local store tiers'
        unpinned ones) and restate what is held on the KV-event stream; loop thread only."""
        key_prefix = b"" if self.store is None else self.connector_scheduler.key_space.prefix
        return reset_caches(self.scheduler, self.store, key_prefix, self.publisher,
                            self.config.cache.block_size, reset_external)

    def end_session(self, session_id: str) -> None:
        """Free the blocks a session holds (loop thread only); its store pins go with ``unpin_session``."""
        self.scheduler.end_session(session_id)

    def pin_session(self, session_id: str, block_hashes) -> None:
        """Keep these blocks of a live session in the store tiers until ``unpin_session``.

        Replaces the session's previous pins; without store tiers nothing to do (the device pool
        then keeps session blocks itself). Safe from any thread (touches only the store's pin table).
        With a network tier (Redis) the pins are applied on a helper thread, in call order, so the
        caller (the HTTP event loop) never waits on the network.
        """
        store = self.store
        if store is not None:
            keys = self.connector_scheduler.key_space.keys(block_hashes)
            self._apply_pins(lambda: store.pin_session(session_id, keys))

    def unpin_session(self, session_id: str) -> None:
        """Let the store tiers evict the session's blocks (those no other session pins); any thread."""
        store = self.store
        if store is not None:
            self._apply_pins(lambda: store.unpin_session(session_id))

    def _apply_pins(self, change) -> None:
        """Run a pin change now, or on the pin thread (in order) when a tier is on the network."""
        if not self.store.has_network_tier:
            change()
            return
        with self._network_stats_lock:
            if self._pin_thread is None:
                self._pin_thread = ThreadPoolExecutor(1, thread_name_prefix="kvhive-tier-pins")
            self._pin_thread.submit(change)

    def pinned_blocks_by_tier(self) -> dict[str, int]:
        """How many of the distinct blocks live sessions pin each store tier holds; any thread.

        A network tier (Redis) is asked on a helper thread, waited for at most
        NETWORK_STATS_WAIT_S (then its previous answer stands); while it is down it holds 0."""
        store = self.store
        if store is None:
            return {}
        keys = store.pinned_keys()
        counts = {}
        for index, name in enumerate(store.tier_names):
            available = store.tier_available(index)
            if available is None:
                counts[name] = store.count_in_tier(index, keys)
            elif not available or not keys:
                counts[name] = 0
            else:
                counts[name] = self._network_count(name, index, keys)
        return counts

    def _network_count(self, name: str, tier_index: int, keys) -> int:
        """``store.count_in_tier(tier_index, keys)`` from a helper thread, or the last answer when slow."""
        store = self.store
        with self._network_stats_lock:
            if self._network_stats is None:
                self._network_stats = ThreadPoolExecutor(1, thread_name_prefix="kvhive-tier-stats")
            future = self._network_stats.submit(lambda: store.count_in_tier(tier_index, keys))
        try:
            count = future.result(timeout=NETWORK_STATS_WAIT_S)
        except FutureTimeout:
            return self._network_counts.get(name, 0)
        self._network_counts[name] = count
        return count

    def close(self) -> None:
        """Flush and close the KV-event publisher; finish KV saves and close the store tiers."""
        for helper in (self._pin_thread, self._network_stats):
            if helper is not None:
                helper.shutdown(wait=True)
        self._pin_thread = self._network_stats = None
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
                    end_session: bool = False, kv_transfer=None) -> None:
        """Queue a request; the caller has checked its length against max_model_len.

        With ``session_id`` the request continues that session's held blocks and, when it ends,
        leaves its own blocks to the session (``end_session``: frees them instead).
        ``kv_transfer`` (a KVTransferParams): its part in a disaggregated prefill/decode transfer.
        """
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context "
                             f"is {self.max_model_len} tokens")
        if sampling.prompt_logprobs is not None and session_id is not None:
            raise ValueError("prompt logprobs cannot be asked in a session: the session's tokens "
                             "are not computed again")
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                          sampling=sampling, eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
                          session_id=session_id, end_session=end_session, kv_transfer=kv_transfer)
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
        outputs = [self._output(req, result, now) for req in self.scheduler.update_from_result(plan, result)]
        self._publish_events()
        return outputs

    def _note_scheduled(self, plan: StepPlan) -> None:
        """Stamp the requests ``plan`` runs for the first time: their time in the queue ends now."""
        now = time.monotonic()
        for seq in plan.seqs:
            req = self._unscheduled.pop(seq.request_id, None)
            if req is not None:
                req.scheduled_time = now

    def _output(self, req: Request, result: StepResult, now: float, error: str | None = None) -> RequestOutput:
        """What the step ``result`` produced for ``req`` at ``now`` (``error``: why it failed, if it did)."""
        token = result.sampled.get(req.request_id)
        logprobs = result.logprobs.get(req.request_id) if token is not None else None
        prompt = self._prompt_logprobs.pop(req.request_id, None)
        if req.is_finished:
            self._unscheduled.pop(req.request_id, None)     # ended before it ever ran (too long)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[] if token is None else [token],
            finished=req.is_finished, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            session_block_hashes=(tuple(req.block_hashes) if req.session_id and req.is_finished
                                  else None),
            logprobs=None if logprobs is None else (logprobs,),
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
                                          w.dropped_save_blocks, w.async_load_seconds, w.async_load_count)
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_usage=s.kv_usage,
                           prefix_cache_queries_tokens=s.prefix_cache_queries_tokens,
                           prefix_cache_hits_tokens=s.prefix_cache_hits_tokens,
                           num_preemptions=s.num_preemptions, num_blocks=self.num_blocks,
                           block_size=self.config.cache.block_size, tiers=tiers, connector=connector,
                           num_session_blocks=s.num_session_blocks, num_session_spills=s.num_session_spills,
                           free_blocks=pool.num_free - pool.num_evictable, cached_blocks=pool.num_evictable,
                           used_blocks=pool.num_used, window_pool=s.kv.window,
                           kv_transfer=None if self.disagg is None else self.disagg.worker.stats())
