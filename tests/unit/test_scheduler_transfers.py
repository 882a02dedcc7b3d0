"""The scheduler's side of KV-connector transfers: lookups, loads, saves and the blocks they hold."""

from __future__ import annotations

from support.scheduler_parts import BLOCK_SIZE, compute, make_kv, make_request

from kvhive.connector.base import CachedBlock, ConnectorMeta, FinishedTransfers, SchedulerOutput
from kvhive.engine.scheduler.kv_transfers import KVTransfers
from kvhive.request import RequestStatus


class RecordingConnector:
    """A connector scheduler half that records what it is told; ``hold`` ids keep their blocks."""

    def __init__(self, hold=()) -> None:
        self.hold = set(hold)
        self.allocs, self.finished, self.outputs = [], [], []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 2 * BLOCK_SIZE, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        self.outputs.append(scheduler_output)
        return ConnectorMeta(saves=tuple((b.block_id, b.block_hash) for b in scheduler_output.newly_cached))

    def request_finished(self, request, block_ids) -> bool:
        self.finished.append((request.request_id, list(block_ids)))
        return request.request_id in self.hold


def test_without_a_connector_nothing_is_looked_up_and_finished_blocks_are_freed():
    kv = make_kv()
    transfers = KVTransfers(None, kv)
    r = make_request("r", range(8))
    assert transfers.lookup(r, 0) == (0, False)
    compute(kv, r)
    transfers.note_computed(r, [0, 1], 0)
    assert not transfers.busy() and transfers.build_meta(("r",), ()) is None
    transfers.release(r)
    assert kv.pool.stats().num_used == 0


def test_computed_blocks_are_saved_once_and_loaded_ones_never():
    kv, connector = make_kv(), RecordingConnector()
    transfers = KVTransfers(connector, kv)
    r = make_request("r", range(12))
    compute(kv, r)
    transfers.note_computed(r, [0, 1, 2], start_pos=BLOCK_SIZE)     # block 0 was loaded
    table = kv.get_block_table(r)
    assert transfers.newly_cached == [CachedBlock(table[i], r.block_hashes[i]) for i in (1, 2)]
    assert transfers.pending_hashes() == set(r.block_hashes[1:3]) and transfers.busy()
    meta = transfers.build_meta(("r",), ("gone",))
    assert meta is not None and len(meta.saves) == 2
    assert connector.outputs[-1].finished_request_ids == ("gone",)
    assert not transfers.busy() and transfers.build_meta((), ()) is None   # handed out once


def test_an_async_load_runs_the_request_with_the_blocks_that_arrived():
    kv, connector = make_kv(), RecordingConnector()
    transfers = KVTransfers(connector, kv)
    r = make_request("r", range(14))
    assert kv.allocate_slots(r, 3 * BLOCK_SIZE)
    transfers.after_alloc(r, 0, 2 * BLOCK_SIZE)
    assert connector.allocs == [("r", kv.get_block_table(r)[:2], 2 * BLOCK_SIZE)]
    transfers.start_load(r, 0)
    assert r.status is RequestStatus.WAITING_FOR_KV and transfers.busy()
    transfers.finish(FinishedTransfers(set(), {"r": 1}))          # the second block failed
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == BLOCK_SIZE
    assert r.num_cached_tokens == BLOCK_SIZE and not transfers.busy()
    assert kv.get_computed_blocks(r).num_computed_tokens == BLOCK_SIZE


def test_a_request_finished_while_loading_holds_its_blocks_until_the_load_reports():
    kv, connector = make_kv(), RecordingConnector()
    transfers = KVTransfers(connector, kv)
    r = make_request("r", range(8))
    assert kv.allocate_slots(r, 8)
    transfers.start_load(r, 0)
    r.status = RequestStatus.FINISHED
    assert transfers.cancel_load(r) and transfers.cancelled_loads == ["r"]
    assert kv.pool.stats().num_used == 2
    table = kv.get_block_table(r)
    transfers.finish(FinishedTransfers(set(), {"r": 0}))          # reported before the cancel went out
    assert transfers.cancelled_loads == [] and kv.pool.stats().num_used == 0
    assert connector.finished == [("r", table)]
    assert not transfers.cancel_load(r)


def test_blocks_the_connector_still_saves_from_are_freed_when_the_save_reports():
    kv, connector = make_kv(), RecordingConnector(hold={"r"})
    transfers = KVTransfers(connector, kv)
    r = make_request("r", range(8))
    compute(kv, r)
    transfers.release(r)
    assert transfers.sending == {"r": r} and kv.pool.stats().num_used == 2
    transfers.finish(FinishedTransfers({"r"}, {}))
    assert transfers.sending == {} and kv.pool.stats().num_used == 0


def test_a_parked_session_request_tells_the_connector_with_no_blocks():
    kv, connector = make_kv(), RecordingConnector()
    transfers = KVTransfers(connector, kv)
    r = make_request("r", range(8), session_id="s")
    transfers.park(r)
    transfers.drop_lookup(r)
    assert connector.finished == [("r", [])] and connector.allocs == [("r", [], 0)]
