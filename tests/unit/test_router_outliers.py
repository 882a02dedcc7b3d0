"""Outlier ejection and the KV-event silence watch as policy (no processes), the gateway's handling
of sick answers against tiny asyncio servers in process (real sockets), and the bounds of the
gateway's time-limit and ejection flags."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket

import pytest
from support.upstream_servers import OK, SSE_HEAD, answers, chunk, forward, gateway_for, sample, served

from kvhive.gateway.cli import add_gateway_args, build_gateway_config, run_gateway
from kvhive.gateway.event_watch import RECEIVING, SILENT, WAITING, EventSilence
from kvhive.gateway.gateway import REASON_HEADER, REPLICA_HEADER
from kvhive.gateway.outlier import OutlierPolicy, OutlierState
from kvhive.gateway.upstream import UpstreamClient, UpstreamMalformed, UpstreamTimeout

POLICY = OutlierPolicy(consecutive_failures=3, base_ejection_s=10, max_ejection_s=25)


def test_failures_in_a_row_eject_for_base_times_ejections_capped() -> None:
    state = OutlierState()
    assert [state.failed(0.0, POLICY) for _ in range(2)] == [None, None]
    assert state.succeeded(0.5) is False and state.consecutive == 0      # a success starts the count over
    assert [state.failed(1.0, POLICY) for _ in range(3)] == [None, None, 10]
    assert state.ejected(5.0) and state.state(5.0) == "ejected"
    assert state.failed(6.0, POLICY) is None and state.succeeded(6.0) is False   # sent before: no say
    # Probation: one failure ejects again, for longer, up to the cap.
    assert state.state(11.0) == "probation" and not state.ejected(11.0)
    assert state.failed(11.0, POLICY) == 20
    assert state.failed(31.0, POLICY) == 25 and state.ejections == 3
    # A success on probation returns it.
    assert state.succeeded(57.0) is True and state.state(57.0) == "ok"
    assert state.ejections == 3


def test_the_ejection_count_falls_while_the_replica_serves() -> None:
    state = OutlierState()
    for start in (0.0, 10.0):                               # ejected, back, ejected again on probation
        for _ in range(3 if start == 0.0 else 1):
            state.failed(start, POLICY)
    assert state.ejections == 2
    assert state.succeeded(40.0)
    # 25 s of service: two base periods off the count, so the next ejection is the base time again.
    assert [state.failed(65.0, POLICY) for _ in range(3)] == [None, None, 10]
    assert state.ejections == 1


def test_no_ejection_when_disabled() -> None:
    state = OutlierState()
    off = OutlierPolicy(consecutive_failures=0)
    assert not off.enabled and all(state.failed(0.0, off) is None for _ in range(100))


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"consecutive_failures": -1}, "--outlier-consecutive-failures"),
    ({"base_ejection_s": 0}, "--outlier-base-ejection-s"),
    ({"base_ejection_s": float("nan")}, "--outlier-base-ejection-s"),
    ({"base_ejection_s": 10, "max_ejection_s": 5}, "--outlier-max-ejection-s"),
])
def test_outlier_policy_bounds(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        OutlierPolicy(**kwargs)


def gateway_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(["--replica", "http://127.0.0.1:1", *flags])


def test_the_flags_reach_the_config_and_bad_values_exit_2() -> None:
    config = build_gateway_config(gateway_args(
        "--request-timeout", "0", "--connect-timeout", "1.5", "--outlier-consecutive-failures", "2",
        "--outlier-base-ejection-s", "1", "--outlier-max-ejection-s", "4", "--events-silent-after", "7"))
    assert (config.request_limit_s, config.connect_timeout_s, config.events_silent_after_s) == (None, 1.5, 7)
    assert config.outliers == OutlierPolicy(2, 1, 4)
    defaults = build_gateway_config(gateway_args())
    assert (defaults.request_limit_s, defaults.connect_timeout_s, defaults.outliers) == (600, 5, OutlierPolicy())
    for bad in (["--request-timeout", "-1"], ["--connect-timeout", "0"],
                ["--events-silent-after", "0"], ["--outlier-consecutive-failures", "-3"],
                ["--outlier-base-ejection-s", "0"], ["--outlier-max-ejection-s", "1"]):
        assert run_gateway(gateway_args(*bad, "--log-level", "warning")) == 2, bad
    with pytest.raises(SystemExit) as refused:      # not a finite number: refused by the parser itself
        gateway_args("--request-timeout", "inf")
    assert refused.value.code == 2


def test_silent_events_are_reported_once_then_their_arrival(caplog: pytest.LogCaptureFixture) -> None:
    watch = EventSilence("http://r1", "tcp://127.0.0.1:5557", silent_after_s=30)
    assert watch.check(100.0, heard=False) == WAITING          # nothing routed yet
    watch.routed(100.0, heard=False)
    watch.routed(120.0, heard=False)                           # the first request starts the clock
    with caplog.at_level(logging.WARNING, logger="kvhive.gateway.event_watch"):
        assert watch.check(129.0, heard=False) == WAITING
        assert [watch.check(t, heard=False) for t in (130.0, 200.0)] == [SILENT, SILENT]
        assert watch.check(201.0, heard=True) == RECEIVING
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "http://r1" in messages[0] and "tcp://127.0.0.1:5557" in messages[0]
    assert "falls back to load" in messages[0] and "arrive now" in messages[1]


def test_garbage_that_is_not_http_goes_to_the_next_replica_and_counts() -> None:
    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        status, headers, body = await forward(gateway)
        assert (status, json.loads(body)) == (200, {"ok": "y"})
        assert (headers[REPLICA_HEADER], headers[REASON_HEADER]) == (urls[1], "retry")
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "malformed"}) == 1
        assert sample(gateway, "kvhive_gateway_upstream_failures_total",
                      {"replica": urls[0], "kind": "malformed"}) == 1
        assert [r.inflight for r in gateway.replicas.replicas] == [0, 0]

    served(answers(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), answers(OK))(go)


def test_a_5xx_goes_to_the_next_replica_once_and_the_last_one_is_relayed() -> None:
    failed = b'HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\nboom'

    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        status, headers, body = await forward(gateway)
        assert (status, headers[REPLICA_HEADER]) == (500, urls[1])          # retried once, no more
        assert json.loads(body)["error"] == {"message": "boom", "type": "server_error", "param": None,
                                             "code": None}
        assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "5xx"}) == 1
        assert sample(gateway, "kvhive_gateway_responses_total", {"replica": urls[2], "status": "200"}) == 0

    served(answers(failed), answers(failed), answers(OK))(go)


def test_every_replica_ejected_still_routes_and_ejected_ones_are_skipped_otherwise() -> None:
    async def go(urls: list[str]) -> None:
        gateway = gateway_for(urls)
        gateway.outliers = OutlierPolicy(consecutive_failures=1, base_ejection_s=60)
        first, second = gateway.replicas.replicas
        gateway.record(first, "5xx")
        assert sample(gateway, "kvhive_gateway_outlier_ejections_total", {"replica": urls[0]}) == 1
        for _ in range(3):
            ranked, _ = await gateway.choose(None, None, "owner")
            assert ranked == [second]
        gateway.record(second, "reset")
        ranked, _ = await gateway.choose(None, None, "owner")
        assert {r.name for r in ranked} == set(urls)
        assert sample(gateway, "kvhive_gateway_outlier_panic_total") == 1

    served(answers(OK), answers(OK))(go)


def test_an_event_stream_that_does_not_begin_as_one_or_comes_too_late_is_the_gateways_error() -> None:
    async def go(urls: list[str]) -> None:
        status, _, body = await forward(gateway_for(urls[:1]))
        assert status == 502 and "event stream began" in json.loads(body)["error"]["message"]
        slow = gateway_for(urls[1:], request_timeout_s=0.3)
        status, headers, body = await forward(slow)
        assert (status, json.loads(body)["error"]["code"]) == (504, "gateway_timeout")
        assert headers[REPLICA_HEADER] == urls[1]
        assert sample(slow, "kvhive_gateway_upstream_timeouts_total", {"replica": urls[1]}) == 1

    served(answers(SSE_HEAD, chunk(b"<html>oops</html>")),
           answers(SSE_HEAD, chunk(b"data: {}\n\n"), delay_s=1.0))(go)


def test_the_request_timeout_bounds_a_whole_answer_of_known_length() -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n"

    async def go(urls: list[str]) -> None:
        client = UpstreamClient(connect_timeout_s=1.0, request_timeout_s=0.3)
        answer = await client.send("POST", urls[0] + "/v1/completions", [], b"{}")
        with pytest.raises(UpstreamTimeout):                # the head came in time, the body did not
            await answer.read()
        answer.close()
        with pytest.raises(UpstreamMalformed):
            await client.send("POST", urls[1] + "/v1/completions", [], b"{}")
        client.close()

    served(answers(head, b'{"ok": "y"}', delay_s=1.0), answers(b"garbage", close=True))(go)


def test_a_replica_that_never_accepts_is_cut_by_the_connect_timeout_and_the_next_one_answers() -> None:
    # A listening socket that never accepts, its backlog filled: a new connection's SYN goes unanswered.
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(0)
        waiting = [socket.socket() for _ in range(8)]
        for s in waiting:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(stuck.getsockname())

        async def go(urls: list[str]) -> None:
            gateway = gateway_for([f"http://127.0.0.1:{stuck.getsockname()[1]}", *urls])
            gateway.upstream.connect_timeout_s = 0.3
            status, headers, _ = await forward(gateway)
            assert (status, headers[REPLICA_HEADER], headers[REASON_HEADER]) == (200, urls[0], "retry")
            assert sample(gateway, "kvhive_gateway_retries_total", {"reason": "connect_timeout"}) == 1

        try:
            served(answers(OK))(go)
        finally:
            for s in waiting:
                s.close()
