"""The scheduler: composes the policy units and applies each step's results.

``schedule()`` plans a step (``batching``: decodes, prefill chunks, then admissions; spilling
idle sessions (``session_spill``) and preempting (``preemption``) when blocks run out) and hands
the connector its transfers (``transfers``). ``update_from_result()`` applies what the step
computed. Requests end in ``_finish``: their blocks are freed, parked in their session, or held
for a transfer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.connector.base import ConnectorScheduler, FinishedTransfers
from kvhive.core.speculative_config import SpeculativeConfig
from kvhive.engine.scheduler.batching import Admission, Batcher, StepBudget
from kvhive.engine.scheduler.kv_transfers import KVTransfers
from kvhive.engine.scheduler.preemption import Preemption
from kvhive.engine.scheduler.prompt_logprobs import prompt_logprobs_span, record_prompt_rows
from kvhive.engine.scheduler.queues import RequestQueues
from kvhive.engine.scheduler.sampling_inputs import suppressed_tokens, token_history
from kvhive.engine.scheduler.session_spill import SessionCopy, SessionSpill
from kvhive.engine.scheduler.speculation import Speculation
from kvhive.engine.speculative.draft_proposals import DraftProposer, SpecDecodeStats
from kvhive.engine.speculative.step_cost import StepCost
from kvhive.engine.step import ScheduledSeq, StepPlan, StepResult
from kvhive.kv.manager import DeviceReset, KVCacheManager, KVCacheStats
from kvhive.kv.window_group import WindowLayout
from kvhive.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerStats:
    """Queue lengths, preemptions and KV cache counters for metrics."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    kv: KVCacheStats
    num_session_blocks: int = 0        # device blocks pinned by idle sessions
    num_session_spills: int = 0        # holdings released to the pool under pressure


class Scheduler:
    """Decides which tokens of which requests each step computes, and applies the step's results."""

    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 root_hash: bytes, connector: ConnectorScheduler | None = None,
                 session_copy: Callable[[Sequence[bytes]], SessionCopy] | None = None,
                 window: WindowLayout | None = None, speculative: SpeculativeConfig | None = None) -> None:
        """``session_copy(hashes)``: where the store tiers hold these full blocks; None: no tiers.
        ``window``: the window layers' own pool (``kvhive.kv.window_group``); None: one pool.
        ``speculative``: drafted decode steps (``speculation``); None: off."""
        self.config = sched_config
        self.kv = KVCacheManager(cache_config.block_size, num_blocks, cache_config.enable_prefix_caching,
                                 root_hash, window)
        self.queues = RequestQueues(by_priority=sched_config.by_priority)
        self.transfers = KVTransfers(connector, self.kv)
        self.transfers.track(self.queues.by_id)
        self.spill = SessionSpill(self.kv, session_copy, self.transfers.pending_hashes)
        self.preemption = Preemption(self.queues, self.kv)
        self.speculation = None if speculative is None else Speculation(
            DraftProposer(speculative), self.kv, sched_config.max_model_len,
            StepCost() if speculative.draft_sizing == "step_cost" else None)
        self.batcher = Batcher(self.queues, self.kv, self.spill, self.preemption, self._finish_too_long,
                               self.speculation)
        self.admission = Admission(sched_config, self.queues, self.kv, self.spill, self.transfers,
                                   self._finish_too_long)
        self._finished_ids: list[str] = []                # ended since the last plan
        self._finished_in_schedule: list[Request] = []    # reported by the next update_from_result

    @property
    def waiting(self) -> deque[Request]:
        """The waiting queue, in admission order (read-only for callers)."""
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        """Running requests in arrival order, those waiting for a KV load included (read-only)."""
        return self.queues.running

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far."""
        return self.preemption.num_preemptions

    @property
    def num_session_spills(self) -> int:
        """Session holdings released to the pool under pressure so far."""
        return self.spill.num_spills

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        self.queues.add(request)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finish a waiting or running request with ``reason`` (ABORT, or ERROR when computing it
        failed) and free its blocks as for any finish; None if unknown. Blocks it computed in a
        step that was not applied (``update_from_result``) never become prefix-cache hits."""
        request = self.queues.by_id.get(request_id)
        if request is None:
            return None
        self.queues.remove(request)
        self._finish(request, reason)
        return request

    def end_session(self, session_id: str) -> None:
        """Free a session's held blocks (and unpin its spilled ones); its unfinished requests free
        theirs when they end."""
        self.kv.sessions.end(session_id)
        for request in self.queues.by_id.values():
            if request.session_id == session_id:
                request.end_session = True

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.queues.by_id.get(request_id)

    def count_cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of these blocks the device prefix cache holds; changes nothing (any thread)."""
        return self.kv.count_cached(block_hashes)

    def reset_prefix_cache(self) -> DeviceReset:
        """Forget the cached blocks no request (running, loading, saving) and no session holds."""
        holders = {**self.transfers.sending, **self.transfers.loading, **self.queues.by_id}
        return self.kv.reset_prefix_cache(holders)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs, or KV transfers are still to start or finish."""
        return bool(self.queues.waiting or self.queues.running or self.transfers.busy())

    def finish_kv_transfers(self, finished: FinishedTransfers) -> None:
        """Apply finished connector transfers: loaded requests become runnable, held blocks are
        freed; a request a cut-short load left without its window context starts again."""
        for request in self.transfers.finish(finished):
            self.preemption.preempt(request)

    def schedule(self) -> StepPlan:
        """Pick this step's tokens: decodes, then running prefill chunks, then FCFS admissions."""
        self.kv.copies.release_sources()          # the last plan's copies have run, applied or not
        if self.speculation is not None:
            self.speculation.begin_step()
        budget = StepBudget.for_step(self.config)
        if not self.batcher.schedule_running(budget):
            self.admission.admit(budget)
        return self._build_plan(budget.planned)

    def update_from_result(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step: append sampled tokens, check stops, cache filled blocks, free finished requests;
        a request in ``result.failed`` finishes with ERROR.

        Returns the requests that got a token or finished (including any that ``schedule`` ended).
        Call it after every ``schedule()``, with an empty StepResult when the plan was empty.
        """
        self.kv.copies.release_sources()          # the step copied them
        touched, self._finished_in_schedule = self._finished_in_schedule, []
        any_finished = False
        for seq in plan.seqs:
            request = self.queues.by_id.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue                    # aborted after the plan was made
            reason = self._apply_seq(request, seq, result)
            if reason is not None:
                self._finish(request, reason)
                any_finished = True
            if seq.sample or reason is FinishReason.ERROR:
                touched.append(request)
        if any_finished:
            self.queues.drop_finished()
        return touched

    def stats(self) -> SchedulerStats:
        """Counters for metrics."""
        kv = self.kv.stats()
        num_loading = len(self.running) - self.queues.num_computing()
        return SchedulerStats(num_running=len(self.running) - num_loading,
                              num_waiting=len(self.waiting) + num_loading,
                              num_preemptions=self.num_preemptions, kv_usage=kv.usage,
                              prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
                              prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens, kv=kv,
                              num_session_blocks=self.kv.sessions.num_blocks,
                              num_session_spills=self.num_session_spills)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The engine took ``seconds`` for the step of ``plan`` (speculation sizes its drafts by it)."""
        if self.speculation is not None:
            self.speculation.observe_step(plan, seconds)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters; None when it is off."""
        return None if self.speculation is None else self.speculation.proposer.stats()

    def _apply_seq(self, request: Request, seq: ScheduledSeq, result: StepResult) -> FinishReason | None:
        """Apply one planned sequence's step to its request; the reason it finishes, or None."""
        request.num_computed_tokens = seq.context_len
        record_prompt_rows(request, seq.prompt_logprobs)
        reason = None
        if seq.request_id in result.failed:
            reason = FinishReason.ERROR         # its KV was computed; its row was not
            request.num_computed_tokens -= len(seq.draft_token_ids)
        elif seq.draft_token_ids:
            reason = self.speculation.apply(request, seq, result, self._stop_reason)
        elif seq.sample:
            token = result.sampled.get(seq.request_id)
            if token is None:
                raise ValueError(f"step result has no token for sampled request {seq.request_id!r}")
            request.append_output_token(token)
            # A complete constrained output stops even at max_tokens: it is whole.
            reason = FinishReason.STOP if seq.request_id in result.completed else self._stop_reason(request, token)
        # Blocks filled by this step become shareable now, before the request ends.
        stored = self.kv.cache_full_blocks(request, request.num_computed_tokens)
        self.transfers.note_computed(request, stored, seq.start_pos)     # before the window slides
        self.kv.slide_window(request)
        return reason

    def _build_plan(self, planned: dict[str, int]) -> StepPlan:
        """The plan for ``planned`` (request id -> tokens), with the ids finished since the last one."""
        seqs = []
        for request_id, num_new in planned.items():
            request = self.queues.by_id[request_id]
            start = request.num_computed_tokens
            drafts = () if self.speculation is None else self.speculation.planned.get(request_id, ())
            end = start + num_new - len(drafts)
            sample = end == request.num_tokens      # never re-samples tokens it already has
            seqs.append(ScheduledSeq(
                request_id=request_id,
                token_ids=request.all_token_ids[start:end] + list(drafts),
                draft_token_ids=drafts,
                start_pos=start,
                block_table=self.kv.get_block_table(request),
                window_table=self.kv.get_window_table(request),
                sample=sample,
                sampling=request.sampling,
                num_output_tokens=request.num_output_tokens,
                prompt_logprobs=prompt_logprobs_span(request, start, end),
                history=token_history(request) if sample else None,
                suppress_token_ids=suppressed_tokens(request) if sample else (),
            ))
        finished, self._finished_ids = self._finished_ids, []
        meta = self.transfers.build_meta(tuple(planned), finished, planned)
        return StepPlan(seqs=seqs, finished_request_ids=finished, connector_meta=meta,
                        block_copies=self.kv.copies.take())

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        """STOP on an end-of-sequence or stop token, LENGTH at max_tokens or max_model_len, else None."""
        sampling = request.sampling
        if (not sampling.ignore_eos and token in request.eos_token_ids) or token in sampling.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= sampling.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish_too_long(self, request: Request) -> None:
        """End a request (already out of the queues) that can never fit; reported by the next update."""
        self._finish(request, FinishReason.LENGTH)
        self._finished_in_schedule.append(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Mark a request finished (the caller removed it from the queues) and let go of its blocks:
        held while its load is in flight, parked in its session, or released."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.speculation is not None:
            self.speculation.finish(request)
        del self.queues.by_id[request.request_id]
        self._finished_ids.append(request.request_id)
        if self.transfers.cancel_load(request):         # freed when its load reports back
            return
        if request.session_id is not None and not request.end_session:
            # Parked blocks stay allocated, so a connector's saves from them stay valid.
            self.transfers.park(request)
            self.kv.park_session(request, request.session_id)
            return
        self.transfers.release(request)
