"""The scheduler's side of speculative decoding: planning drafted decode steps, applying verdicts.

Before the decode pass every request in decode gets its drafts from the ``DraftProposer``; with
draft sizing "step_cost" the step then keeps the draft tokens that raise its expected tokens per
second by the step cost the engine measured (``kvhive.engine.speculative.step_cost``), and now
and then a request whose drafts were cut keeps one token more (a probe, ``Probes``), so its
acceptance estimate follows its text. A request with drafts left is planned as its last known token plus
those drafts, all charged to the step's token budget, in blocks allocated for them; when those blocks are not free the request takes a plain one-token step instead (drafts
never spill sessions or preempt anyone). After the step the emitted tokens (accepted drafts, then
the target model's token) are appended one by one, each checked for a stop, and nothing after a
stop is kept. Rollback: the request's computed tokens cover its last known token and the accepted
drafts only, and the blocks allocated for rejected positions alone are freed, so a block is hashed
(cached, announced, offered to the tiers, parked in a session) only once it is full of accepted
tokens; slots a rejected draft wrote are overwritten when their position is computed again.
"""

from __future__ import annotations

from collections.abc import Callable

from kvhive.engine.scheduler.batching import StepBudget
from kvhive.engine.speculative.draft_proposals import DraftProposer
from kvhive.engine.speculative.step_cost import Probes, StepCost, size_drafts
from kvhive.engine.step import ScheduledSeq, StepPlan, StepResult
from kvhive.kv.manager import KVCacheManager
from kvhive.request import FinishReason, Request


class Speculation:
    """Drafted steps of the running requests (one instance per scheduler, with speculation on)."""

    def __init__(self, proposer: DraftProposer, kv: KVCacheManager, max_model_len: int,
                 cost: StepCost | None = None) -> None:
        """``cost``: the measured step cost the drafts are sized by; None: each request drafts its
        own adaptive length (draft sizing "per_request")."""
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.cost = cost
        self.planned: dict[str, tuple[int, ...]] = {}     # this step's drafts by request id
        self._proposed: dict[str, list[int]] = {}         # this step's drafts before planning
        self._probes = Probes()

    def begin_step(self) -> None:
        """Forget the last plan's drafts (the step that verified them has been applied)."""
        self.planned.clear()
        self._probes.lapse()

    def propose(self, decodes: list[Request], plain_tokens: int, num_running: int) -> None:
        """Draft for each request in decode this step, then size the drafts together.
        ``plain_tokens``: the step's expected tokens without drafts; ``num_running``: the requests
        running (none drafts when they are more than the config's ``disable_by_batch_size``)."""
        self._proposed.clear()
        limit = self.proposer.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return
        for request in decodes:
            # Never draft past max_tokens or the context: the last draft's successor ends the request.
            room = min(request.sampling.max_tokens - request.num_output_tokens,
                       self.max_model_len - request.num_tokens) - 1
            drafts = self.proposer.propose(request, room)
            if drafts:
                self._proposed[request.request_id] = drafts
        if self.cost is None or not self._proposed:
            return
        kept = size_drafts({rid: self.proposer.chances(rid, len(d)) for rid, d in self._proposed.items()},
                           plain_tokens, len(decodes), self.cost)
        proposed = {rid: len(d) for rid, d in self._proposed.items()}
        for rid in self._probes.pick(kept, proposed, plain_tokens, self.cost):
            kept[rid] += 1
        for rid, n in kept.items():
            self._proposed[rid] = self._proposed[rid][:n]

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The step of ``plan`` took ``seconds``. Only steps of decode rows (plain or drafted) are
        learned: a draft row is a decode row, and a prefill chunk's rows cost another amount each
        (only the chunk's last row needs logits), which priced draft rows by prefill."""
        if self.cost is not None and plan.decode_rows_only:
            self.cost.observe(plan.num_tokens, seconds)

    def plan(self, request: Request, budget: StepBudget) -> bool:
        """Plan a drafted decode step for ``request`` (in decode) with the drafts ``propose`` kept
        for it; False (nothing planned or allocated) when it has none, the budget leaves no room for
        one, or blocks are short."""
        drafts = self._proposed.pop(request.request_id, None)
        if not drafts:
            return False
        start = request.num_computed_tokens
        num_new = budget.fit(start, 1 + len(drafts))
        drafts = drafts[:num_new - 1]
        if not drafts or not self.kv.allocate_slots(request, 1 + len(drafts)):
            return False
        budget.take(request.request_id, 1 + len(drafts), start)
        self.planned[request.request_id] = tuple(drafts)
        return True

    def apply(self, request: Request, seq: ScheduledSeq, result: StepResult,
              stop_reason: Callable[[Request, int], FinishReason | None]) -> FinishReason | None:
        """Append what a drafted step emitted for ``request`` up to the first stop, roll back the
        rejected drafts' KV and adapt the draft length; the reason the request finishes, or None."""
        token = result.sampled.get(seq.request_id)
        if token is None:
            raise ValueError(f"step result has no token for sampled request {seq.request_id!r}")
        accepted = result.accepted_drafts.get(seq.request_id, ())
        reason = None
        emitted = (*accepted, token)
        for i, t in enumerate(emitted):
            request.append_output_token(t)
            # A complete structured output stops even at max_tokens (only its last token completes it).
            complete = i == len(emitted) - 1 and seq.request_id in result.completed
            reason = FinishReason.STOP if complete else stop_reason(request, t)
            if reason is not None:
                break
        # KV is valid for the last known token and the accepted drafts; the token emitted last
        # is computed by the next step, as after a plain step.
        request.num_computed_tokens = min(seq.start_pos + 1 + len(accepted), request.num_tokens - 1)
        self.kv.trim_blocks(request, request.num_computed_tokens)    # as many as after a plain step
        self.proposer.record(seq.request_id, len(seq.draft_token_ids), len(accepted))
        self._probes.settle(seq.request_id, len(seq.draft_token_ids), len(accepted))
        return reason

    def finish(self, request: Request) -> None:
        """Drop a finished request's drafting state (the proposer may keep its tokens as history)."""
        self.planned.pop(request.request_id, None)
        self._probes.forget(request.request_id)
        self.proposer.finish(request)
