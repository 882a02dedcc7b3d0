"""Building blocks for the scheduler units' tests: a KV manager, requests, computed and parked blocks."""

from __future__ import annotations

from kvhive.core.blocks import root_hash
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
