"""Continuous batching with chunked prefill and preemption by recompute (torch-free).

Each step, under ``max_num_batched_tokens`` tokens and ``max_num_seqs`` running requests:

1. every running request in decode gets its one token;
2. running requests still in prefill get their next chunk;
3. waiting requests are admitted in FCFS order (prefix lookup on admission); the head of the queue
   blocks everything behind it when it does not fit, so nothing starves.

When a running request cannot get blocks, the newest running request is preempted: its blocks are
freed (its computed full blocks stay cached, so re-admission mostly hits), it keeps its output
tokens and goes back to the front of the waiting queue. Invariants between steps: ``running`` is in
arrival order and every running request arrived before every waiting one.

With a KV connector, admission also asks the store tiers for the blocks after the device hits.
A lookup still running off the loop (a slow tier) holds the head of the queue like a request
that does not fit: admission stops there for this step, running requests keep stepping, and the
head asks again next step (the connector keeps one answer per admission attempt, so waiting
repeats no store query). A synchronous load (bytes in memory) is computed on in the same step;
an asynchronous one parks the request in ``running`` as WAITING_FOR_KV (holding its blocks,
never scheduled nor preempted) until ``finish_kv_transfers`` reports how many blocks arrived. A
request aborted while its load is in flight keeps its blocks until the load reports back; the
next plan tells the worker to cut that load short. Blocks a step computed are handed to the
connector in the next plan's ``connector_meta`` to be saved.

A request asking for prompt logprobs needs the logits of every prompt row: until they have all
gone out it is admitted with no prefix hits and no tier lookup (it still publishes its blocks), and
each chunk's plan names the rows it reports (``PromptLogprobsSpan``; none twice after a preemption).

Sessions: a finished request with a ``session_id`` parks its blocks in the KV manager instead of
freeing them; the session's next request resumes them at admission when its prompt continues
the session's tokens (no hashing, no prefix lookup), else the holding is released and the request
takes the ordinary prefix path. Held blocks are pinned in the device pool. With store tiers
configured, when blocks run out the least recently used holding that has a copy below is released
to the pool (spilled) before anything is preempted; its next request finds its blocks by prefix
match, on the device or loaded back from the tiers. ``session_copy`` says where a holding's full
blocks are (``SessionCopy``): in the lowest tier (spill), on their way there (saves in flight:
wait a step), or not going there (the lowest tier is down, emptied or full): then in a tier above
(spill), or nowhere. A holding with no copy anywhere, and every holding without tiers, follows the
no-tier rule: when the head of the queue does not fit while nothing runs (so nothing else will
ever free a block), the least recently used such holding is released, its full blocks cached in
the pool until evicted and recomputed after that. Idle sessions never stall a request forever,
whatever a tier lost.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.connector.base import CachedBlock, ConnectorScheduler, FinishedTransfers, SchedulerOutput
from kvhive.engine.step import PromptLogprobsSpan, ScheduledSeq, StepPlan, StepResult
from kvhive.kv.manager import KVCacheManager, KVCacheStats
from kvhive.request import FinishReason, Request, RequestStatus


class SessionCopy(enum.Enum):
    """Where the store tiers hold copies of an idle session's full blocks."""

    LOWEST = "lowest"      # the lowest tier holds every one: spill
    PENDING = "pending"    # saves of some are still on their way to it: wait
    HIGHER = "higher"      # it will not get them (down, emptied, full), a tier above holds them all: spill
    NONE = "none"          # no tier holds them all, and none will: the no-tier rule


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
                 session_copy: Callable[[Sequence[bytes]], SessionCopy] | None = None) -> None:
        """``session_copy(hashes)``: where the store tiers hold these full blocks; None: no tiers."""
        self.config = sched_config
        self.connector = connector
        self.session_copy = session_copy
        self.num_session_spills = 0
        self.kv = KVCacheManager(cache_config.block_size, num_blocks, cache_config.enable_prefix_caching,
                                 root_hash)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}           # unfinished requests, waiting or running
        self._finished_ids: list[str] = []                # ended since the last plan
        self._finished_in_schedule: list[Request] = []    # reported by the next update_from_result
        # Connector state: blocks computed since the last plan (to save); requests whose blocks
        # a transfer still uses (async load in flight, or saves the connector asked to hold).
        self._newly_cached: list[CachedBlock] = []
        self._loading: dict[str, Request] = {}
        self._sending: dict[str, Request] = {}
        self._cancelled_loads: list[str] = []             # aborted while loading, since the last plan

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finish a waiting or running request with ``reason`` (ABORT, or ERROR when computing it
        failed) and free its blocks as for any finish; None if unknown. Blocks it computed in a
        step that was not applied (``update_from_result``) never become prefix-cache hits."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV):
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)
        return request

    def end_session(self, session_id: str) -> None:
        """Free a session's held blocks; its unfinished requests free theirs when they end."""
        self.kv.release_session(session_id)
        for request in self._requests.values():
            if request.session_id == session_id:
                request.end_session = True

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs, or KV transfers are still to start or finish."""
        return bool(self.waiting or self.running or self._newly_cached or self._loading or self._sending)

    def finish_kv_transfers(self, finished: FinishedTransfers) -> None:
        """Apply finished connector transfers: loaded requests become runnable, held blocks are freed."""
        B = self.kv.block_size
        for request_id, num_loaded in finished.done_recving.items():
            request = self._loading.pop(request_id)
            if request.is_finished:        # aborted while loading: its blocks were held for the load
                if request_id in self._cancelled_loads:     # reported before the cancel went out
                    self._cancelled_loads.remove(request_id)
                self._release(request)
                continue
            # Blocks after the first one that failed stay allocated and are recomputed.
            request.num_computed_tokens += num_loaded * B
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.RUNNING
        for request_id in finished.done_sending:
            request = self._sending.pop(request_id, None)
            if request is not None and request_id not in self._loading:
                self.kv.free(request)

    def schedule(self) -> StepPlan:
        """Pick this step's tokens: decodes, then running prefill chunks, then FCFS admissions."""
        budget = self.config.max_num_batched_tokens
        planned: dict[str, int] = {}        # request id -> tokens this step, in plan order
        preempted = False
        for decode_pass in (True, False):
            for request in list(self.running):
                if request.status is not RequestStatus.RUNNING or request.request_id in planned:
                    continue
                remaining = request.num_tokens - request.num_computed_tokens
                if (remaining == 1) != decode_pass or budget == 0:
                    continue
                num_new = min(remaining, budget)
                if self.kv.num_blocks_for(request.num_computed_tokens + num_new) > self.kv.num_usable_blocks:
                    # Can never fit, even alone in the pool: end it rather than preempt forever.
                    self.running.remove(request)
                    self._finish(request, FinishReason.LENGTH)
                    self._finished_in_schedule.append(request)
                    continue
                while not self.kv.allocate_slots(request, num_new):
                    if self._spill_session():
                        continue
                    # Newest arrival still computing (request itself at worst); a request whose
                    # load is in flight keeps its blocks.
                    victim = next(r for r in reversed(self.running) if r.status is RequestStatus.RUNNING)
                    budget += planned.pop(victim.request_id, 0)
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                else:
                    planned[request.request_id] = num_new
                    budget -= num_new
        if not preempted:
            budget = self._admit_waiting(budget, planned)
        return self._build_plan(planned)

    def update_from_result(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step: append sampled tokens, check stops, cache filled blocks, free finished requests;
        a request in ``result.failed`` finishes with ERROR.

        Returns the requests that got a token or finished (including any that ``schedule`` ended).
        Call it after every ``schedule()``, with an empty StepResult when the plan was empty.
        """
        touched, self._finished_in_schedule = self._finished_in_schedule, []
        any_finished = False
        for seq in plan.seqs:
            request = self._requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue                    # aborted after the plan was made
            request.num_computed_tokens = seq.context_len
            if seq.prompt_logprobs is not None:
                span = seq.prompt_logprobs
                request.num_prompt_logprob_rows = span.first_pos + len(span.next_token_ids)
            reason = None
            if seq.request_id in result.failed:
                reason = FinishReason.ERROR         # its KV was computed; its row was not
            elif seq.sample:
                token = result.sampled.get(seq.request_id)
                if token is None:
                    raise ValueError(f"step result has no token for sampled request {seq.request_id!r}")
                request.append_output_token(token)
                reason = self._stop_reason(request, token)
            # Blocks filled by this step become shareable now, before the request ends.
            stored = self.kv.cache_full_blocks(request, request.num_computed_tokens)
            if self.connector is not None and stored:
                # Blocks below start_pos were loaded or hit, not computed: nothing new to save.
                table, first = self.kv.get_block_table(request), seq.start_pos // self.kv.block_size
                self._newly_cached += [CachedBlock(table[i], request.block_hashes[i]) for i in stored if i >= first]
            if reason is not None:
                self._finish(request, reason)
                any_finished = True
            if seq.sample or reason is FinishReason.ERROR:
                touched.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return touched

    def stats(self) -> SchedulerStats:
        """Counters for metrics."""
        kv = self.kv.stats()
        num_loading = len(self.running) - sum(1 for r in self.running if r.status is RequestStatus.RUNNING)
        return SchedulerStats(num_running=len(self.running) - num_loading,
                              num_waiting=len(self.waiting) + num_loading,
                              num_preemptions=self.num_preemptions, kv_usage=kv.usage,
                              prefix_cache_queries_tokens=kv.prefix_cache_queries_tokens,
                              prefix_cache_hits_tokens=kv.prefix_cache_hits_tokens, kv=kv,
                              num_session_blocks=self.kv.num_session_blocks,
                              num_session_spills=self.num_session_spills)

    def _spill_session(self, keep: str | None = None, admitting: bool = False) -> bool:
        """Release the least recently used holding (other than ``keep``) to the pool; False if none.

        With tiers, a holding whose full blocks have a copy below (the lowest tier, or a tier above
        it when the lowest will not get them); one whose saves are still in flight waits (the
        partial last block is recomputed on resume). Without tiers, or when no tier holds a
        holding's blocks, only for an admission stuck with nothing running (``admitting``).
        """
        stuck = admitting and not self.running
        if self.session_copy is None and not stuck:
            return False
        pending = {b.block_hash for b in self._newly_cached}     # computed, not yet handed to saves
        uncopied = None
        for session_id in self.kv.session_ids():
            if session_id == keep:
                continue
            if self.session_copy is not None:
                held = self.kv.session_blocks(session_id)
                hashes = held.block_hashes[:held.num_cached_blocks]
                if any(h in pending for h in hashes):
                    continue
                copy = self.session_copy(hashes) if hashes else SessionCopy.LOWEST
                if copy is SessionCopy.NONE:
                    uncopied = uncopied or session_id
                    continue
                if copy is SessionCopy.PENDING:
                    continue
            elif not stuck:
                continue
            self._release_holding(session_id)
            return True
        if uncopied is not None and stuck:
            self._release_holding(uncopied)          # recomputed on its next turn
            return True
        return False

    def _release_holding(self, session_id: str) -> None:
        self.kv.release_session(session_id)
        self.num_session_spills += 1

    def _admit_waiting(self, budget: int, planned: dict[str, int]) -> int:
        # FCFS: stop at the first request that does not fit, so later ones never jump ahead.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self.kv.num_blocks_for(request.num_tokens) > self.kv.num_usable_blocks:
                # The prompt alone needs more blocks than the pool has: finish with LENGTH.
                self.waiting.popleft()
                self._finish(request, FinishReason.LENGTH)
                self._finished_in_schedule.append(request)
                continue
            if request.session_id is not None:
                held = self.kv.session_prefix(request)
                if held:
                    num_new = min(request.num_tokens - held, budget)
                    while not self.kv.resume_session(request, num_new):
                        if not self._spill_session(keep=request.session_id, admitting=True):
                            return budget
                    self._start_running(request, held, num_new, planned)
                    budget -= num_new
                    continue
                # Diverged (or nothing held): the session follows this request's history.
                self.kv.release_session(request.session_id)
            if request.needs_prompt_rows:
                # Its prompt logprobs need every prompt row computed: no device or tier hits (its
                # blocks are still published to the prefix cache as they fill).
                num_new = min(request.num_tokens, budget)
                if not self._allocate_or_spill(request, num_new):
                    break
                self._start_running(request, 0, num_new, planned)
                budget -= num_new
                continue
            hit = self.kv.get_computed_blocks(request)
            if self._prefix_in_flight(request, len(hit.blocks)):
                # Next step the block is a device hit instead of computed twice; checked before
                # the tier lookup so a waiting request costs no store round trip per step.
                break
            num_external, is_async = 0, False
            if self.connector is not None:
                num_external, is_async = self.connector.get_num_new_matched_tokens(request, hit.num_computed_tokens)
                if num_external is None:
                    break           # its tier lookup is still running; FCFS: the rest wait too
            computed = hit.num_computed_tokens + num_external
            # An async load computes nothing until its blocks arrive; it takes no token budget.
            num_new = 0 if is_async else min(request.num_tokens - computed, budget)
            if not self.kv.allocate_slots(request, num_external + num_new, hit.blocks):
                if self._spill_session(keep=request.session_id, admitting=True):
                    continue        # look the request up again: the spill may have evicted hits
                break
            self.waiting.popleft()
            self.running.append(request)
            if self.connector is not None:
                first = len(hit.blocks)
                external_blocks = self.kv.get_block_table(request)[first:first + num_external // self.kv.block_size]
                self.connector.update_state_after_alloc(request, external_blocks, num_external)
            if is_async:
                request.num_computed_tokens = hit.num_computed_tokens
                request.status = RequestStatus.WAITING_FOR_KV
                self._loading[request.request_id] = request
                continue
            request.num_computed_tokens = computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            request.status = RequestStatus.RUNNING
            planned[request.request_id] = num_new
            budget -= num_new
        return budget

    def _allocate_or_spill(self, request: Request, num_new: int) -> bool:
        """Blocks for ``num_new`` tokens of a request admitted without prefix hits, spilling idle
        sessions while short; False when they do not fit."""
        while not self.kv.allocate_slots(request, num_new):
            if not self._spill_session(keep=request.session_id, admitting=True):
                return False
        return True

    def _start_running(self, request: Request, num_cached: int, num_new: int, planned: dict[str, int]) -> None:
        """Move the head of the queue, its blocks allocated and no tier load pending, to running:
        ``num_cached`` tokens already in its blocks, ``num_new`` computed this step."""
        self.waiting.popleft()
        self.running.append(request)
        if self.connector is not None:      # drop a lookup an earlier attempt kept
            self.connector.update_state_after_alloc(request, (), 0)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        planned[request.request_id] = num_new

    def _prefix_in_flight(self, request: Request, num_hit_blocks: int) -> bool:
        """True when a running prefill is computing the block this request needs next.

        Admitting it now would compute that block twice in the same step (seed 004's pitfall, in
        its concurrent form); waiting one step turns it into a cache hit. The running request is
        scheduled before admissions every step, so the wait always ends.
        """
        if not self.kv.enable_prefix_caching or num_hit_blocks >= len(request.block_hashes):
            return False
        wanted = request.block_hashes[num_hit_blocks]
        B = self.kv.block_size
        for other in self.running:
            if other.status is not RequestStatus.RUNNING or other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            pending = other.block_hashes[other.num_computed_tokens // B:other.num_prompt_tokens // B]
            if wanted in pending:
                return True
        return False

    def _build_plan(self, planned: dict[str, int]) -> StepPlan:
        seqs = []
        for request_id, num_new in planned.items():
            request = self._requests[request_id]
            start = request.num_computed_tokens
            end = start + num_new
            seqs.append(ScheduledSeq(
                request_id=request_id,
                token_ids=request.all_token_ids[start:end],
                start_pos=start,
                block_table=self.kv.get_block_table(request),
                sample=end == request.num_tokens,   # never re-samples tokens it already has
                sampling=request.sampling,
                num_output_tokens=request.num_output_tokens,
                prompt_logprobs=self._prompt_logprobs_span(request, start, end),
            ))
        finished, self._finished_ids = self._finished_ids, []
        meta = None
        if self.connector is not None:
            output = SchedulerOutput(tuple(planned), tuple(finished), tuple(self._newly_cached),
                                     tuple(self._cancelled_loads))
            self._newly_cached, self._cancelled_loads = [], []
            meta = self.connector.build_connector_meta(output)
            meta = None if meta.is_empty else meta
        return StepPlan(seqs=seqs, finished_request_ids=finished, connector_meta=meta)

    @staticmethod
    def _prompt_logprobs_span(request: Request, start: int, end: int) -> PromptLogprobsSpan | None:
        """The prompt rows of chunk [start, end) whose logprobs have not gone out yet (a chunk
        recomputed after a preemption reports nothing twice); None for most requests."""
        if not request.needs_prompt_rows:
            return None
        first = max(start, request.num_prompt_logprob_rows)
        last = min(end, request.num_prompt_tokens - 1)     # row P - 1 scores the first output token
        if first >= last:
            return None
        return PromptLogprobsSpan(first, tuple(request.prompt_token_ids[first + 1:last + 1]),
                                  request.sampling.prompt_logprobs)

    def _preempt(self, request: Request) -> None:
        # Recompute later: drop all KV (full blocks stay cached), keep the tokens, go to the front.
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if (not sampling.ignore_eos and token in request.eos_token_ids) or token in sampling.stop_token_ids:
            return FinishReason.STOP
        if request.num_output_tokens >= sampling.max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason) -> None:
        # The caller removes the request from running / waiting.
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
        if request.request_id in self._loading:        # freed when its load reports back
            self._cancelled_loads.append(request.request_id)
            return
        if request.session_id is not None and not request.end_session:
            # Parked blocks stay allocated, so a connector's saves from them stay valid.
            if self.connector is not None:
                self.connector.request_finished(request, ())
            self.kv.park_session(request, request.session_id)
            return
        self._release(request)

    def _release(self, request: Request) -> None:
        # Free a finished request's blocks, unless the connector still saves from them.
        if self.connector is not None and self.connector.request_finished(
                request, self.kv.get_block_table(request)):
            self._sending[request.request_id] = request
            return
        self.kv.free(request)
