"""The engine stamps its outputs with when each request was queued, first scheduled and produced
(the server's queue, prefill and decode times): on the tiny model, in the test's own process."""

from __future__ import annotations

from support.engines import GREEDY, make_engine

from kvhive.request import SamplingParams


def test_outputs_carry_queue_schedule_and_output_stamps_in_order(tokenizer) -> None:
    engine = make_engine(tokenizer, max_seqs=1)         # one request at a time: the second one waits
    try:
        engine.add_request("first", list(range(3, 23)), GREEDY)
        engine.add_request("second", list(range(30, 50)), GREEDY)
        outputs = {"first": [], "second": []}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].append(out)
    finally:
        engine.close()
    for outs in outputs.values():
        assert len(outs) == GREEDY.max_tokens and outs[-1].finished
        first = outs[0]
        assert first.scheduled_time is not None
        assert first.queued_time <= first.scheduled_time <= first.output_time
        assert {(o.queued_time, o.scheduled_time) for o in outs} == {(first.queued_time, first.scheduled_time)}
        assert [o.output_time for o in outs] == sorted(o.output_time for o in outs)
    # The second request sat in the queue until the first finished.
    assert outputs["second"][0].scheduled_time >= outputs["first"][-1].output_time


def test_a_request_finished_before_it_runs_or_aborted_while_waiting_leaves_nothing_behind(tokenizer) -> None:
    engine = make_engine(tokenizer, max_seqs=1, num_blocks=8)
    try:
        engine.add_request("runs", list(range(3, 13)), GREEDY)
        engine.add_request("aborted", list(range(3, 13)), GREEDY)
        engine.add_request("too-long", list(range(3, 63)), SamplingParams(max_tokens=4))   # > 8 blocks of 4
        engine.abort_request("aborted")
        ended = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    ended[out.request_id] = out
        assert ended["too-long"].scheduled_time is None and ended["too-long"].new_token_ids == []
        assert ended["runs"].scheduled_time is not None
        assert engine._unscheduled == {}
    finally:
        engine.close()
