"""Building blocks for the scheduler's tests: a KV manager, requests, computed and parked blocks, and
a whole ``Scheduler`` driven by a fake runner that reads its "KV" back through the block tables."""

from __future__ import annotations

from kvhive.config import CacheConfig, SchedulerConfig
from kvhive.core.blocks import root_hash
from kvhive.engine.scheduler import Scheduler
from kvhive.engine.step import StepPlan, StepResult
from kvhive.kv.manager import KVCacheManager
from kvhive.request import Request, RequestStatus, SamplingParams

BLOCK_SIZE = 4


def make_kv(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    """A KV manager of ``num_blocks`` blocks of BLOCK_SIZE tokens (block 0 is the null block)."""
    return KVCacheManager(BLOCK_SIZE, num_blocks, caching, root_hash(0))


def make_request(rid: str, prompt, max_tokens: int = 8, session_id: str | None = None,
                 **sampling) -> Request:
    """A request over ``prompt`` (any iterable of token ids)."""
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling),
                   session_id=session_id)


def compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> None:
    """Give a request blocks for its first ``num_tokens`` tokens (all of them by default), as if a
    step computed them: RUNNING, the tokens counted computed, full blocks cached."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate_slots(request, num_tokens - request.num_computed_tokens)
    request.num_computed_tokens = num_tokens
    request.status = RequestStatus.RUNNING
    kv.cache_full_blocks(request, num_tokens)


def park(kv: KVCacheManager, session_id: str, prompt) -> Request:
    """A finished request of ``session_id`` over ``prompt``, its blocks parked in the session."""
    request = make_request(f"{session_id}-turn", prompt, session_id=session_id)
    compute(kv, request)
    kv.park_session(request, session_id)
    return request


VOCAB = 97


# ------------------------------------------------------------ a whole scheduler and a fake runner

def next_token(context: list[int]) -> int:
    """The fake model: a position-weighted checksum of the whole context."""
    return sum((i + 1) * t for i, t in enumerate(context)) % VOCAB


def reference(prompt: list[int], max_tokens: int, eos: tuple[int, ...] = (), max_model_len: int = 10**9) -> list[int]:
    """Tokens an unconstrained run produces."""
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeRunner:
    """Writes (token, position) into slots via the block table; samples from what it reads back."""

    def __init__(self, sched: Scheduler) -> None:
        self.pool = sched.kv.pool
        self.B = sched.kv.block_size
        self.slots: dict[int, tuple[int, int]] = {}

    def slot(self, table: list[int], p: int) -> int:
        return table[p // self.B] * self.B + p % self.B

    def execute(self, plan: StepPlan) -> StepResult:
        sampled = {}
        for src, dst, n in plan.block_copies:
            source, target = self.pool.blocks[src], self.pool.blocks[dst]
            assert source.ref_cnt > 0 and source.token_ids is not None and n <= len(source.token_ids), \
                "a copy source must be pinned and listed with the tokens copied"
            assert target.ref_cnt > 0 and target.block_hash is None and 0 < n < self.B
            for i in range(n):
                self.slots[dst * self.B + i] = self.slots[src * self.B + i]
        for seq in plan.seqs:
            for i, tok in enumerate(seq.token_ids):
                p = seq.start_pos + i
                block = self.pool.blocks[seq.block_table[p // self.B]]
                assert block.block_id != 0 and block.ref_cnt > 0
                assert block.block_hash is None, "a step must never overwrite a cached block"
                self.slots[self.slot(seq.block_table, p)] = (tok, p)
            if seq.sample:
                context = []
                for p in range(seq.context_len):
                    tok, pos = self.slots[self.slot(seq.block_table, p)]
                    assert pos == p
                    context.append(tok)
                sampled[seq.request_id] = next_token(context)
        return StepResult(sampled)


def make_sched(block_size=4, num_blocks=64, max_num_seqs=4, budget=64, max_model_len=10_000, caching=True,
               connector=None, long_prefill=0, max_long=1):
    """A whole Scheduler over a pool of ``num_blocks`` blocks (block 0 is the null block); prefills of
    more than ``long_prefill`` tokens are long (0: none), ``max_long`` of them per step."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len, long_prefill_token_threshold=long_prefill,
                                     max_long_partial_prefills=max_long),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     num_blocks, root_hash(0), connector=connector)


def req(rid: str, prompt: list[int], max_tokens: int = 8, eos: tuple[int, ...] = (),
        session_id: str | None = None, **sampling) -> Request:
    """A request for the whole scheduler (``make_sched``), in ``session_id`` when given."""
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling), eos_token_ids=eos,
                   session_id=session_id)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[StepPlan, list[Request]]:
    """One engine step with every invariant checked."""
    plan = sched.schedule()
    cfg = sched.config
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(plan.seqs) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
    out = sched.update_from_result(plan, runner.execute(plan))
    sched.kv.pool.check_integrity()
    held = {b for r in sched.running for b in sched.kv.get_block_table(r)}
    held |= {b.block_id for sid in sched.kv.sessions.ids() for b in sched.kv.sessions.get(sid).blocks}
    assert sched.kv.pool.stats().num_used == len(held)
    assert all(not sched.kv.get_block_table(r) for r in sched.waiting)
    # Blocks exactly cover the computed tokens: nothing over-allocated.
    assert all(len(sched.kv.get_block_table(r)) == sched.kv.num_blocks_for(r.num_computed_tokens)
               for r in sched.running)
    return plan, out


def drive(sched: Scheduler, runner: FakeRunner | None = None, max_steps: int = 5000) -> list[StepPlan]:
    runner, plans = runner or FakeRunner(sched), []
    while sched.has_unfinished():
        plans.append(step(sched, runner)[0])
        assert len(plans) < max_steps, "no progress"
    return plans
