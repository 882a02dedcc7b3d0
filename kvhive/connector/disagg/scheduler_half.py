"""The scheduler half of disaggregated serving, wrapped around an optional inner connector.

Prefill role: a request with ``do_remote_decode`` gets, every step that computes its prompt, a
``KVSend`` naming the blocks that step fills (its prefix hits go with the first step); the step
that completes the prompt ends the transfer. Decode role: a request with ``do_remote_prefill`` is
admitted with its device hits and an asynchronous ``RemoteLoad`` of the rest of its prompt but the
last token, which the decode side computes to sample its first token (so admitting it costs one
row, not a prefill of the partial block); the worker reports how many blocks landed intact and the
scheduler recomputes the rest. The transfer's blocks are the prompt's full blocks up to the last
token, named by their hashes, then the partial block holding the tokens before it, if any, named by
``hash_tail`` (it is never cached under that name). Such a
request's ``num_cached_tokens`` (``cached_tokens`` in its usage) counts reused tokens only: the
longer of its device hits and the prefill's hits (``prefill_cached_tokens``), not transferred ones.
Everything else (and every request without transfer params) goes to the inner connector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvhive.connector.base import ConnectorMeta, ConnectorScheduler, KVSend, RemoteLoad, SchedulerOutput
from kvhive.core.blocks import ExtraKeys, hash_tail


@dataclass
class _Sending:
    """A prefill request whose blocks are being sent: their hashes and the next block to send."""

    request: Any
    hashes: tuple[bytes, ...]
    next_block: int = 0


class DisaggScheduler:
    """ConnectorScheduler for ``--kv-role prefill|decode`` over an optional inner connector."""

    def __init__(self, role: str, block_size: int, root: bytes, inner: ConnectorScheduler | None = None) -> None:
        """``root``: the engine's root block hash (names a partial first block)."""
        self.role, self.block_size, self.root, self.inner = role, block_size, root, inner
        self._sending: dict[str, _Sending] = {}
        self._remote: set[str] = set()              # decode: lookups this half answered
        self._loads: list[RemoteLoad] = []
        self._ended: list[str] = []
        self.remote_load_requests = 0

    def _is_remote_decode(self, request: Any) -> bool:
        params = request.kv_transfer
        return self.role == "decode" and params is not None and params.do_remote_prefill

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode role, remote request: the prompt but its last token, after the device hits, arrives
        asynchronously; anything else: the inner connector's answer."""
        if self._is_remote_decode(request):
            wanted = request.num_prompt_tokens - 1
            if wanted > num_computed_tokens:
                self._remote.add(request.request_id)
                return wanted - num_computed_tokens, True
        if self.inner is None:
            return 0, False
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int,
                                 window_block_ids: Sequence[int] | None = None) -> None:
        """Record a remote load, start tracking a prefill's sends, or hand over to the inner half
        (disaggregation keeps one pool: ``window_block_ids`` is always None here)."""
        rid = request.request_id
        params = request.kv_transfer
        if self.role == "prefill" and params is not None and params.do_remote_decode and rid not in self._sending:
            self._sending[rid] = _Sending(request, self.transfer_hashes(request))
        if rid in self._remote:
            self._remote.discard(rid)
            if num_external_tokens > 0:
                hashes = self.transfer_hashes(request)
                first = len(hashes) - len(block_ids)
                self._loads.append(RemoteLoad(rid, params.transfer_id, first, tuple(block_ids),
                                              hashes[first:]))
                self.remote_load_requests += 1
                self._count_reused(request, first)
            return
        if self.inner is not None:
            self.inner.update_state_after_alloc(request, block_ids, num_external_tokens, window_block_ids)

    def transfer_hashes(self, request: Any) -> tuple[bytes, ...]:
        """The names of the blocks a transfer carries: the prompt's full blocks before its last
        token, then the partial block of the tokens before it (``hash_tail``), if any."""
        prompt = request.all_token_ids[:request.num_prompt_tokens - 1]
        full = tuple(request.block_hashes[:len(prompt) // self.block_size])
        tail = hash_tail(prompt, self.block_size, self.root, full, ExtraKeys(cache_salt=request.cache_salt))
        return full if tail is None else (*full, tail)

    def _count_reused(self, request: Any, num_hit_blocks: int) -> None:
        """Report as cached what either side reused: the longer of this side's device hits and
        the prefill's own hits (both are prefixes of one prompt); transferred blocks were
        computed for this request, so they are not counted."""
        if request.num_cached_tokens < 0:           # set once, at first admission
            limit = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
            own = num_hit_blocks * self.block_size
            request.num_cached_tokens = min(max(own, request.kv_transfer.prefill_cached_tokens), limit)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        """The inner connector's meta plus this step's sends, remote loads and ended transfers."""
        meta = ConnectorMeta() if self.inner is None else self.inner.build_connector_meta(scheduler_output)
        sends = [send for rid in scheduler_output.scheduled_request_ids if rid in self._sending
                 for send in [self._plan_send(rid, scheduler_output)] if send is not None]
        loads, ended = tuple(self._loads), tuple(self._ended)
        self._loads, self._ended = [], []
        if not (sends or loads or ended):
            return meta
        return replace(meta, kv_sends=tuple(sends), remote_loads=loads, ended_sends=ended)

    def _plan_send(self, rid: str, output: SchedulerOutput) -> KVSend | None:
        """The blocks request ``rid``'s step fills (and earlier ones not yet sent)."""
        state = self._sending[rid]
        request = state.request
        end = request.num_computed_tokens + output.num_scheduled_tokens.get(rid, 0)
        last = end >= request.num_prompt_tokens
        # The decode side computes the prompt's last token itself: a block is ready once every
        # token of it before that one is computed.
        ready = min(end, request.num_prompt_tokens - 1)
        full = min(-(-ready // self.block_size), len(state.hashes)) if last else ready // self.block_size
        table = output.block_tables.get(rid, ())
        first, state.next_block = state.next_block, max(state.next_block, full)
        if last:
            del self._sending[rid]
        elif first >= full:
            return None
        params = request.kv_transfer
        return KVSend(params.transfer_id, params.decode_endpoint, first, tuple(table[first:full]),
                      state.hashes, last)

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> bool:
        """Forget the request; a prefill that ends before its prompt did ends its transfer."""
        rid = request.request_id
        self._remote.discard(rid)
        if self._sending.pop(rid, None) is not None:
            self._ended.append(request.kv_transfer.transfer_id)
        return False if self.inner is None else self.inner.request_finished(request, block_ids)
