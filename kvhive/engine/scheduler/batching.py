"""Continuous batching with chunked prefill: the token budget, running requests, admission.

Each step, under ``max_num_batched_tokens`` tokens (with ``--step-budget compute``, a token at
position p counts 1 + p / C: ``StepBudget``) and ``max_num_seqs`` running requests:

1. every running request in decode gets its one token (with speculative decoding, maybe its
   drafts too: ``speculation``);
2. running requests still in prefill get their next chunk;
3. waiting requests are admitted in the queue's order, FCFS or by request priority (prefix lookup
   on admission); the head of the queue blocks everything behind it when it does not fit, so
   nothing behind it overtakes it, with two exceptions: a request waiting for a block another
   prefill is computing (next step it is a hit), and a long prefill waiting for its place.

With ``--long-prefill-token-threshold`` T, a prefill with more than T tokens left is long: it gets
at most T tokens a step, and at most ``--max-long-partial-prefills`` long prefills get a chunk in
one step, after the short ones. A request arriving while a long prompt is prefilled then waits
for one chunk of it, not all of it, and a prefix hit's short remainder is not queued behind it.

A request short of blocks first spills idle sessions (``session_spill``: least recently used
first, whatever the tiers hold); a running request still short then preempts the newest running
request, and a step that preempted admits nothing; a waiting head still short waits. A request that cannot fit even alone in the pool
finishes with LENGTH.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from kvhive.core.scheduler_config import SchedulerConfig
from kvhive.engine.scheduler.kv_transfers import KVTransfers
from kvhive.engine.scheduler.preemption import Preemption
from kvhive.engine.scheduler.queues import RequestQueues
from kvhive.engine.scheduler.session_spill import SessionSpill
from kvhive.kv.manager import KVCacheManager
from kvhive.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvhive.engine.scheduler.speculation import Speculation


class StepBudget:
    """The work a step may still schedule, and the tokens planned per request (in plan order).

    Work is counted in tokens. With ``attention_context`` C, a token at position p counts
    1 + p / C: its attention over the p keys before it costs p / C times its projections, C being
    the context at which the two are equal (``ModelConfig.attention_balance_context``). A step of
    long-context prefill chunks then takes about as long as one of short ones instead of several
    times longer, so requests that arrive together do not all wait for one long step.
    """

    def __init__(self, num_tokens: int, attention_context: int | None = None,
                 long_threshold: int = 0, max_long: int = 1) -> None:
        self.tokens = num_tokens                   # work left, in token-equivalents; may end below 0
        self.attention_context = attention_context
        self.long_threshold = long_threshold       # 0: no prefill is long
        self.max_long = max_long
        self.planned: dict[str, int] = {}
        self._charged: dict[str, int] = {}
        self._long: set[str] = set()               # planned requests whose prefill is long

    @classmethod
    def for_step(cls, config: SchedulerConfig) -> StepBudget:
        """A fresh budget for one step under ``config``."""
        return cls(config.max_num_batched_tokens, config.attention_context,
                   config.long_prefill_token_threshold, config.max_long_partial_prefills)

    def is_long(self, remaining: int) -> bool:
        """Whether a prefill with ``remaining`` tokens left is long (chunked at the threshold)."""
        return 0 < self.long_threshold < remaining

    def fit_prefill(self, start_pos: int, remaining: int) -> int:
        """How many of a prefill's ``remaining`` tokens from ``start_pos`` this step takes: what the
        work left covers, a long one at most ``long_threshold``, and none once ``max_long`` long
        prefills have a chunk this step."""
        if not self.is_long(remaining):
            return self.fit(start_pos, remaining)
        if self.long_places_taken:
            return 0
        return self.fit(start_pos, self.long_threshold)

    @property
    def long_places_taken(self) -> bool:
        """Whether ``max_long`` long prefills already have a chunk this step."""
        return len(self._long) >= self.max_long

    def cost(self, start_pos: int, num_tokens: int) -> int:
        """The work of ``num_tokens`` tokens at positions ``start_pos``, ``start_pos + 1``, ..."""
        context = self.attention_context
        if not context or num_tokens <= 0:
            return max(num_tokens, 0)
        # sum of 1 + p / C over the chunk's positions, rounded up
        return num_tokens + -(-num_tokens * (2 * start_pos + num_tokens - 1) // (2 * context))

    def fit(self, start_pos: int, wanted: int) -> int:
        """How many of ``wanted`` tokens from ``start_pos`` on the work left covers; at least one
        while nothing is planned, so a step always makes progress."""
        if self.cost(start_pos, wanted) <= self.tokens:
            return wanted
        lo, hi = 0, wanted                          # cost(lo) fits, cost(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.cost(start_pos, mid) <= self.tokens else (lo, mid)
        return lo if lo or self.planned else min(wanted, 1)

    def take(self, request_id: str, num_tokens: int, start_pos: int = 0, remaining: int = 0) -> None:
        """Plan ``num_tokens`` tokens of a request from position ``start_pos`` this step, of the
        ``remaining`` its prefill has left (a long one takes one of the ``max_long`` places)."""
        charged = self.cost(start_pos, num_tokens)
        self.planned[request_id] = num_tokens
        self._charged[request_id] = charged
        self.tokens -= charged
        if self.is_long(remaining):
            self._long.add(request_id)

    def give_back(self, request_id: str) -> None:
        """Unplan a request (preempted): its work returns to the budget; no change if unplanned."""
        self.planned.pop(request_id, None)
        self._long.discard(request_id)
        self.tokens += self._charged.pop(request_id, 0)


class Batcher:
    """Plans the running requests' tokens: decodes first, then prefill chunks."""

    def __init__(self, queues: RequestQueues, kv: KVCacheManager, spill: SessionSpill,
                 preemption: Preemption, finish_too_long: Callable[[Request], None],
                 speculation: Speculation | None = None) -> None:
        """``finish_too_long(request)``: end a request (already out of the queues) with LENGTH.
        ``speculation``: plans drafted decode steps (``kvhive.engine.scheduler.speculation``); None: off."""
        self.queues = queues
        self.kv = kv
        self.spill = spill
        self.preemption = preemption
        self.finish_too_long = finish_too_long
        self.speculation = speculation

    def schedule_running(self, budget: StepBudget) -> bool:
        """Plan a token for each decode, then a chunk for each short prefill, then for the long ones
        (``StepBudget.fit_prefill``), each pass in arrival order, while the budget lasts; True when a
        request was preempted for blocks."""
        preempted = False
        if self.speculation is not None:
            self.speculation.propose(*self._decodes(budget), len(self.queues.running))
        for kind in ("decode", "short", "long"):
            for request in list(self.queues.running):
                if request.status is not RequestStatus.RUNNING or request.request_id in budget.planned:
                    continue
                remaining = request.num_tokens - request.num_computed_tokens
                if budget.tokens <= 0 or _prefill_kind(remaining, budget) != kind:
                    continue
                if kind == "decode" and self.speculation is not None and self.speculation.plan(request, budget):
                    continue
                num_new = budget.fit_prefill(request.num_computed_tokens, remaining)
                if num_new:
                    preempted |= self._schedule_chunk(request, num_new, budget)
        return preempted

    def _decodes(self, budget: StepBudget) -> tuple[list[Request], int]:
        """The running requests in decode this step, and the step's tokens without drafts: theirs
        and, up to the budget's rest, the running prefills' next chunks (drafts are sized by them)."""
        decodes, prefill = [], 0
        for request in self.queues.running:
            if request.status is not RequestStatus.RUNNING or request.request_id in budget.planned:
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining == 1:
                decodes.append(request)
            else:
                prefill += min(remaining, budget.long_threshold) if budget.is_long(remaining) else remaining
        return decodes, len(decodes) + max(0, min(prefill, budget.tokens - len(decodes)))

    def _schedule_chunk(self, request: Request, num_new: int, budget: StepBudget) -> bool:
        """Allocate blocks for ``num_new`` tokens of a running request and plan them, spilling and
        then preempting while short; True when anything (the request itself, at worst) was preempted."""
        if self.kv.num_blocks_for(request.num_computed_tokens + num_new) > self.kv.num_usable_blocks:
            # Can never fit, even alone in the pool: end it rather than preempt forever.
            self.queues.running.remove(request)
            self.finish_too_long(request)
            return False
        preempted = False
        while not self.kv.allocate_slots(request, num_new):
            if self.spill.spill():
                continue
            victim = self.preemption.pick_victim()
            budget.give_back(victim.request_id)
            self.preemption.preempt(victim)
            preempted = True
            if victim is request:
                return True
        budget.take(request.request_id, num_new, request.num_computed_tokens,
                    request.num_tokens - request.num_computed_tokens)
        return preempted


def _short_of(budget: StepBudget, remaining: int) -> Admit:
    """Why a waiting prefill with ``remaining`` tokens got no tokens: a long one whose places are
    taken is passed over (short ones behind it may go); otherwise the budget is spent."""
    return Admit.PASSED if budget.is_long(remaining) and budget.long_places_taken else Admit.STOP


def _prefill_kind(remaining: int, budget: StepBudget) -> str:
    """Which pass of ``Batcher.schedule_running`` plans a running request with ``remaining``
    tokens to compute: decode (one), short or long prefill."""
    if remaining == 1:
        return "decode"
    return "long" if budget.is_long(remaining) else "short"


class Admit(Enum):
    """What admitting one waiting request came to: admitted; to be tried again; passed over this
    step (it waits for a block another prefill is computing, or for a long-prefill place) while
    those behind it may go; or admission stops for this step (short of budget or blocks, or its
    tier lookup runs)."""

    ADMITTED = "admitted"
    RETRY = "retry"         # an idle session was spilled for its blocks: try it again
    PASSED = "passed"
    STOP = "stop"


class Admission:
    """Admits waiting requests in the queue's order (FCFS or by priority): session resume, prefix hits, tier loads."""

    def __init__(self, config: SchedulerConfig, queues: RequestQueues, kv: KVCacheManager,
                 spill: SessionSpill, transfers: KVTransfers,
                 finish_too_long: Callable[[Request], None]) -> None:
        """``finish_too_long(request)``: end a request (already out of the queues) with LENGTH."""
        self.config = config
        self.queues = queues
        self.kv = kv
        self.spill = spill
        self.transfers = transfers
        self.finish_too_long = finish_too_long

    def admit(self, budget: StepBudget) -> None:
        """Move waiting requests to running while the budget and ``max_num_seqs`` allow, in queue
        order; stop at the first that does not fit (or whose tier lookup still runs), so none jumps
        ahead of it. Only a request passed over (``Admit.PASSED``) lets those behind it go first."""
        waiting, running = self.queues.waiting, self.queues.running
        at = 0
        while at < len(waiting) and budget.tokens > 0 and len(running) < self.config.max_num_seqs:
            request = waiting[at]
            if self.kv.num_blocks_for(request.num_tokens) > self.kv.num_usable_blocks:
                # The prompt alone needs more blocks than the pool has: finish with LENGTH.
                waiting.remove(request)
                self.finish_too_long(request)
                continue
            outcome = self._admit_one(request, budget)
            if outcome is Admit.STOP:
                return
            if outcome is Admit.PASSED:
                at += 1

    def _admit_one(self, request: Request, budget: StepBudget) -> Admit:
        """Try to admit one waiting request."""
        if request.session_id is not None:
            held = self.kv.sessions.prefix_of(request)
            if held:
                return self._resume_session(request, held, budget)
            # Diverged (or nothing held): the session follows this request's history.
            self.kv.sessions.release(request.session_id)
        if request.needs_prompt_rows:
            return self._admit_without_hits(request, budget)
        return self._admit_with_prefix(request, budget)

    def _resume_session(self, request: Request, held: int, budget: StepBudget) -> Admit:
        """Give the request its session's ``held`` computed tokens (no hashing, no prefix lookup)."""
        num_new = budget.fit_prefill(held, request.num_tokens - held)
        if not num_new:
            return _short_of(budget, request.num_tokens - held)
        while not self.kv.resume_session(request, num_new):
            if not self._spill_for(request):
                return Admit.STOP
        self._start_running(request, held, num_new, budget)
        return Admit.ADMITTED

    def _admit_without_hits(self, request: Request, budget: StepBudget) -> Admit:
        """Admit a request whose prompt logprobs need every prompt row computed: no device or tier
        hits (its blocks are still published to the prefix cache as they fill)."""
        num_new = budget.fit_prefill(0, request.num_tokens)
        if not num_new:
            return _short_of(budget, request.num_tokens)
        while not self.kv.allocate_slots(request, num_new):
            if not self._spill_for(request):
                return Admit.STOP
        self._start_running(request, 0, num_new, budget)
        return Admit.ADMITTED

    def _admit_with_prefix(self, request: Request, budget: StepBudget) -> Admit:
        """Admit with its device prefix hits and any blocks the tiers hold after them."""
        hit = self.kv.get_computed_blocks(request)
        if self._prefix_in_flight(request, len(hit.blocks)):
            # Next step the block is a device hit instead of computed twice; checked before the
            # tier lookup so a waiting request costs no store round trip per step.
            return Admit.PASSED
        num_external, is_async = self.transfers.lookup(request, hit.num_computed_tokens)
        if num_external is None:
            return Admit.STOP       # its tier lookup is still running; FCFS: the rest wait too
        # Where the tiers have nothing more, the leading tokens of the next block may be on the
        # device in a sibling block: copied, not computed. Pinned so allocating cannot evict it.
        source, num_partial = self.kv.copies.find(request, len(hit.blocks)) if not num_external else (None, 0)
        if source is not None:
            self.kv.copies.pin(source)
        while True:
            computed = hit.num_computed_tokens + num_external + num_partial
            # An async load computes nothing until its blocks arrive; it takes no token budget.
            num_new = 0 if is_async else budget.fit_prefill(computed, request.num_tokens - computed)
            if not is_async and not num_new:
                if source is not None:
                    self.kv.copies.unpin(source)
                return _short_of(budget, request.num_tokens - computed)
            if self.kv.allocate_slots(request, num_external + num_partial + num_new, hit.blocks, num_external):
                break
            if source is None:
                # Spilled a session: look it up again (the spill may evict hits); else stop.
                return Admit.RETRY if self._spill_for(request) else Admit.STOP
            # Short of blocks by the pinned source itself, maybe: try again without the partial hit.
            self.kv.copies.unpin(source)
            source, num_partial = None, 0
        self.queues.start(request)
        self.transfers.after_alloc(request, len(hit.blocks), num_external)
        if is_async:
            self.transfers.start_load(request, hit.num_computed_tokens)
            return Admit.ADMITTED
        if source is not None:
            self.kv.take_partial_hit(request, len(hit.blocks), source, num_partial)
        request.num_computed_tokens = computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = computed
        request.status = RequestStatus.RUNNING
        budget.take(request.request_id, num_new, computed, request.num_tokens - computed)
        return Admit.ADMITTED

    def _spill_for(self, request: Request) -> bool:
        """Spill an idle session (not the request's own) to make room; False if none could go."""
        return self.spill.spill(keep=request.session_id)

    def _start_running(self, request: Request, num_cached: int, num_new: int, budget: StepBudget) -> None:
        """Move a waiting request, its blocks allocated and no tier load pending, to running:
        ``num_cached`` tokens already in its blocks, ``num_new`` computed this step."""
        self.queues.start(request)
        self.transfers.drop_lookup(request)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        budget.take(request.request_id, num_new, num_cached, request.num_tokens - num_cached)

    def _prefix_in_flight(self, request: Request, num_hit_blocks: int) -> bool:
        """True when a running prefill is computing the block this request needs next.

        Admitting it now would compute that block twice in the same step; waiting one step turns
        it into a cache hit. The running request is scheduled before admissions every step, so
        the wait always ends.
        """
        if not self.kv.enable_prefix_caching or num_hit_blocks >= len(request.block_hashes):
            return False
        wanted = request.block_hashes[num_hit_blocks]
        B = self.kv.block_size
        for other in self.queues.running:
            if other.status is not RequestStatus.RUNNING or other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            if wanted in other.block_hashes[other.num_computed_tokens // B:other.num_prompt_tokens // B]:
                return True
        return False
