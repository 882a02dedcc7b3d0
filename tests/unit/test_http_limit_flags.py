"""The HTTP limit flags of ``kvhive serve`` and ``kvhive gateway``: defaults, bounds (exit 2 naming
the flag), the config built from them, and the head size the protocol counts."""

from __future__ import annotations

import argparse
import resource

import h11
import pytest

from kvhive.cli import main
from kvhive.core.http_limits import (
    BOUNDS,
    MAX_DEFAULT_CONNECTIONS,
    HttpLimits,
    add_http_limit_args,
    default_max_connections,
    http_limits_from_args,
)
from kvhive.core.http_protocol import HeadLimitedConnection, head_bytes
from kvhive.gateway.cli import add_gateway_args, build_gateway_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhive serve")
    add_http_limit_args(parser)
    return parser


def test_defaults_fit_long_streams_and_the_open_file_limit() -> None:
    limits = http_limits_from_args(_parser().parse_args([]))
    assert limits == HttpLimits()
    assert (limits.max_header_bytes, limits.max_headers) == (65536, 100)
    assert (limits.header_timeout_s, limits.keep_alive_timeout_s) == (30.0, 30.0)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert limits.max_connections == default_max_connections() <= MAX_DEFAULT_CONNECTIONS
    assert soft == resource.RLIM_INFINITY or limits.max_connections <= max(1, soft // 2)


def test_flags_set_every_limit() -> None:
    args = _parser().parse_args(["--http-max-header-bytes", "4096", "--http-max-headers", "20",
                                 "--http-header-timeout", "2.5", "--http-keep-alive-timeout", "0.5",
                                 "--http-max-connections", "64"])
    assert http_limits_from_args(args) == HttpLimits(4096, 20, 2.5, 0.5, 64)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--http-max-header-bytes", "1023", "must be in [1024, 16777216], got 1023"),
    ("--http-max-header-bytes", "64k", "'64k' is not a whole number"),
    ("--http-max-headers", "0", "must be in [1, 10000], got 0"),
    ("--http-header-timeout", "0", "must be in (0, 3600], got 0"),
    ("--http-header-timeout", "soon", "'soon' is not a number"),
    ("--http-keep-alive-timeout", "-1", "must be in (0, 3600], got -1"),
    ("--http-keep-alive-timeout", "3601", "must be in (0, 3600], got 3601"),
    ("--http-max-connections", "0", "must be in [1, 1048576], got 0"),
])
@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_value_out_of_bounds_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], command: str,
                                                       flag: str, value: str, says: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, flag, value])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"usage: kvhive {command}" in error
    assert f"argument {flag}: {says}" in error


def test_the_config_refuses_what_the_flags_refuse() -> None:
    for name, bound in BOUNDS.items():
        with pytest.raises(ValueError, match=bound.flag):
            HttpLimits(**{name: 0})


def test_the_gateway_config_carries_its_limits() -> None:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    config = build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--http-max-headers", "7"]))
    assert config.http.max_headers == 7 and config.http.header_timeout_s == 30.0


def _parsed(raw: bytes, limits: HttpLimits) -> object:
    """The event h11 parses from ``raw`` under ``limits``, or the status it is refused with."""
    conn = HeadLimitedConnection(limits)
    conn.receive_data(raw)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return conn.refusal[0]
    return event


def test_head_bytes_counts_the_request_line_and_fields() -> None:
    raw = b"GET /health HTTP/1.1\r\nHost: example\r\nX-A: b\r\n\r\n"
    request = _parsed(raw, HttpLimits())
    assert isinstance(request, h11.Request) and head_bytes(request) == len(raw)


def test_a_head_over_a_limit_is_refused_431_even_when_it_arrives_whole() -> None:
    limits = HttpLimits(max_header_bytes=1024, max_headers=3)
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(2))
    assert isinstance(_parsed(b"GET / HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n", limits), h11.Request)
    assert _parsed(b"GET / HTTP/1.1\r\nHost: h\r\n" + fields + b"X-3: v\r\n\r\n", limits) == 431
    assert _parsed(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 1010 + b"\r\n\r\n", limits) == 431
    assert _parsed(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 2000, limits) == 431     # unfinished
    assert _parsed(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 500, limits) is h11.NEED_DATA
    assert _parsed(b"NOT HTTP\r\n\r\n", limits) == 400
