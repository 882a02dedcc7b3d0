"""The scheduler's side of KV-connector transfers: tier lookups, loads, saves, held blocks.

- Admission asks the connector for blocks after the device hits (``lookup``). A lookup still
  running answers None: the request waits at the head of the queue and asks again next step.
- A synchronous load is computed on in the same step; an asynchronous one parks the request in
  ``running`` as WAITING_FOR_KV, holding its blocks, until ``finish`` reports how many arrived.
- A request finished while its load is in flight keeps its blocks until the load reports back;
  the next plan tells the worker to cut that load short (``cancelled_loads``).
- Blocks a step computed are handed to the connector in the next plan's meta to be saved, with
  the retention priority their request gives them (the connector may leave low ones unsaved).
- A finished request whose blocks the connector still saves from waits in ``sending``.

Without a connector every method is a no-op, ``lookup`` answers (0, False) and ``release`` frees.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvhive.connector.base import (
    CachedBlock,
    ConnectorMeta,
    ConnectorScheduler,
    FinishedTransfers,
    SchedulerOutput,
)
from kvhive.kv.manager import KVCacheManager
from kvhive.kv.pool import NULL_BLOCK_ID
from kvhive.kv.retention_policy import block_retention_at
from kvhive.request import Request, RequestStatus


class KVTransfers:
    """Requests whose blocks a transfer uses, and blocks computed since the last plan."""

    def __init__(self, connector: ConnectorScheduler | None, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.newly_cached: list[CachedBlock] = []       # computed since the last plan: to save
        self.loading: dict[str, Request] = {}           # async load in flight
        self.sending: dict[str, Request] = {}           # finished; the connector still saves from them
        self.cancelled_loads: list[str] = []            # finished while loading, since the last plan
        # Requests restarted after a load that left them without their window context: their next
        # admission computes instead of asking the tiers again.
        self.skip_lookup: set[str] = set()
        # The scheduler's unfinished requests by id (set by the scheduler): block tables for the meta.
        self._requests: Mapping[str, Request] | None = None

    def track(self, requests: Mapping[str, Request]) -> None:
        """Read scheduled requests' block tables from ``requests`` (the scheduler's by-id map)."""
        self._requests = requests

    def busy(self) -> bool:
        """True while saves are still to hand out, or loads or held saves are unfinished."""
        return bool(self.newly_cached or self.loading or self.sending)

    def pending_hashes(self) -> set[bytes]:
        """Hashes of blocks computed but not yet handed to the connector's saves."""
        return {b.block_hash for b in self.newly_cached}

    def lookup(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the tiers hold after ``num_computed_tokens`` and whether loading them is async;
        None while the lookup still runs. Without a connector: (0, False)."""
        if self.connector is None or request.request_id in self.skip_lookup:
            return 0, False
        return self.connector.get_num_new_matched_tokens(request, num_computed_tokens)

    def after_alloc(self, request: Request, first_block: int, num_external: int) -> None:
        """Tell the connector which blocks (from ``first_block``) receive the ``num_external`` tokens."""
        self.skip_lookup.discard(request.request_id)
        if self.connector is not None:
            end = first_block + -(-num_external // self.kv.block_size)     # a transfer may end mid-block
            blocks = self.kv.get_block_table(request)[first_block:end]
            window = self.kv.get_window_table(request)
            if window is None:
                self.connector.update_state_after_alloc(request, blocks, num_external)
            else:
                self.connector.update_state_after_alloc(request, blocks, num_external, window[first_block:end])

    def drop_lookup(self, request: Request) -> None:
        """Forget a lookup an earlier admission attempt kept (the request loads nothing)."""
        self.skip_lookup.discard(request.request_id)
        if self.connector is not None:
            self.connector.update_state_after_alloc(request, (), 0)

    def start_load(self, request: Request, num_computed_tokens: int) -> None:
        """Park an admitted request as WAITING_FOR_KV until its async load reports back."""
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request

    def note_computed(self, request: Request, stored: Sequence[int], start_pos: int) -> None:
        """Queue for saving the newly cached blocks ``stored`` (indices) a step computed from
        ``start_pos`` on; blocks below it were loaded or hit, not computed."""
        if self.connector is None or not stored:
            return
        table, first = self.kv.get_block_table(request), start_pos // self.kv.block_size
        window = self.kv.get_window_table(request)
        for i in stored:
            # Read before the window slides: a block just computed still has its window part.
            if i < first or (window is not None and window[i] == NULL_BLOCK_ID):
                continue
            priority = block_retention_at(request.retention, i, self.kv.block_size, request.num_tokens,
                                          request.num_prompt_tokens).priority
            self.newly_cached.append(CachedBlock(table[i], request.block_hashes[i],
                                                 None if window is None else window[i], priority))

    def cancel_load(self, request: Request) -> bool:
        """For a request that just finished: True (its load is cut short, its blocks held until it
        reports back) when its load is in flight, else False."""
        if request.request_id not in self.loading:
            return False
        self.cancelled_loads.append(request.request_id)
        return True

    def park(self, request: Request) -> None:
        """Tell the connector a session request finished; its blocks stay allocated in the session."""
        self.skip_lookup.discard(request.request_id)
        if self.connector is not None:
            self.connector.request_finished(request, ())

    def release(self, request: Request) -> None:
        """Free a finished request's blocks, unless the connector still saves from them."""
        self.skip_lookup.discard(request.request_id)
        if self.connector is not None and self.connector.request_finished(
                request, self.kv.get_block_table(request)):
            self.sending[request.request_id] = request
            return
        self.kv.free(request)

    def finish(self, finished: FinishedTransfers) -> list[Request]:
        """Apply finished transfers: loaded requests become RUNNING, held blocks are freed.
        Returns the requests to restart from their first token (see ``_finish_load``)."""
        restart = []
        for request_id, num_loaded in finished.done_recving.items():
            request = self.loading.pop(request_id)
            if not self._finish_load(request, num_loaded):
                restart.append(request)
        for request_id in finished.done_sending:
            request = self.sending.pop(request_id, None)
            if request is not None and request_id not in self.loading:
                self.kv.free(request)
        return restart

    def build_meta(self, scheduled: Sequence[str], finished: Sequence[str],
                   num_tokens: Mapping[str, int] | None = None) -> ConnectorMeta | None:
        """The connector's meta for the next plan (loads, saves, cancels); None when empty or
        without a connector. Hands out the blocks and cancels gathered since the last call.
        ``num_tokens``: the step's tokens per scheduled request (with their block tables)."""
        if self.connector is None:
            return None
        num_tokens = num_tokens or {}
        tables = {rid: self.kv.get_block_table(self._requests[rid])
                  for rid in num_tokens} if num_tokens and self._requests is not None else {}
        output = SchedulerOutput(tuple(scheduled), tuple(finished), tuple(self.newly_cached),
                                 tuple(self.cancelled_loads), num_tokens, tables)
        self.newly_cached, self.cancelled_loads = [], []
        meta = self.connector.build_connector_meta(output)
        return None if meta.is_empty else meta

    def _finish_load(self, request: Request, num_loaded: int) -> bool:
        """A load reported ``num_loaded`` blocks: count them computed, or free a finished request's.

        False when the request must restart instead: a load cut short left window entries it
        skipped (null) inside the window of the point where computing would resume. Its next
        admission computes from its device hits without asking the tiers.
        """
        if request.is_finished:         # finished while loading: its blocks were held for the load
            if request.request_id in self.cancelled_loads:     # reported before the cancel went out
                self.cancelled_loads.remove(request.request_id)
            self.release(request)
            return True
        # A load never supplies the last token (a transfer's last block may be partial).
        resume = min(request.num_computed_tokens + num_loaded * self.kv.block_size, request.num_tokens - 1)
        if not self.kv.has_window_context(request, resume):
            self.skip_lookup.add(request.request_id)
            return False
        # Blocks after the first one that failed stay allocated and are recomputed.
        request.num_computed_tokens = resume
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        return True
