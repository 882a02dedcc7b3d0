"""The replica registry's record and flags without Redis: what a replica advertises, what a gateway
accepts from the registry, and the flags of ``kvhive serve --register`` and ``kvhive gateway
--discover`` (a bad value is a startup error naming it, exit 2).

Against a real redis-server: tests/e2e/test_gateway_registry.py."""

from __future__ import annotations

import argparse
import json

import pytest

from kvhive.cli import main
from kvhive.core.replica_registry import (
    RegistrationConfig,
    ReplicaRecord,
    connectable,
    default_advertise_url,
    record_key,
)
from kvhive.gateway.cli import add_gateway_args, build_gateway_config, run_gateway


def test_a_record_advertises_connectable_event_sockets() -> None:
    config = RegistrationConfig("redis://r:6379/1", "http://10.0.0.7:8001/", ttl_s=6)
    assert config.heartbeat_s == 2.0
    record = config.record("tcp://*:5557", "tcp://0.0.0.0:5558", "fp")
    assert record == ReplicaRecord("http://10.0.0.7:8001", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "fp", 6)
    assert config.record(None, None, "fp").events is None
    assert record_key(record.url) == "kvhive:replica:http://10.0.0.7:8001"
    assert connectable("tcp://[::]:5557", "fd00::1") == "tcp://[fd00::1]:5557"
    assert connectable("tcp://192.168.1.2:5557", "h") == "tcp://192.168.1.2:5557"    # a bound address stays
    assert connectable("ipc:///tmp/kv", "h") == "ipc:///tmp/kv"


def test_the_default_advertised_url_is_reachable_from_elsewhere() -> None:
    assert default_advertise_url("127.0.0.1", 8001) == "http://127.0.0.1:8001"
    assert default_advertise_url("::1", 8001) == "http://[::1]:8001"
    wildcard = default_advertise_url("0.0.0.0", 8001)
    assert wildcard.endswith(":8001") and "0.0.0.0" not in wildcard


def test_records_round_trip_and_anything_else_is_skipped() -> None:
    record = ReplicaRecord("http://h:1", "tcp://h:2", None, "fp", 10.0, leaving=True)
    assert ReplicaRecord.decode(record.encode()) == record
    newer = json.dumps({"url": "http://h:1", "ttl_s": 5, "zone": "eu"}).encode()     # a field added later
    assert ReplicaRecord.decode(newer) == ReplicaRecord("http://h:1", ttl_s=5)
    for bad in (b"not json", b"[1]", b'{"url": 3}', b'{"url": "ftp://h"}', b'{"url": "http://h", "ttl_s": "x"}',
                b'{"url": "http://h", "leaving": 1}', b'{"url": "http://h", "events": 5}',
                json.dumps({"url": "http://h", "fingerprint": "x" * 5000}).encode()):
        assert ReplicaRecord.decode(bad) is None, bad


@pytest.mark.parametrize(("flags", "named"), [
    (["--register", "http://r:6379"], "--register"),
    (["--register", "redis://r", "--register-ttl", "0.5"], "--register-ttl"),
    (["--register", "redis://r", "--register-ttl", "nan"], "--register-ttl"),
    (["--register", "redis://r", "--advertise-url", "10.0.0.7:8001"], "--advertise-url"),
    (["--register", "redis://r", "--advertise-url", "http://h:1/v1"], "--advertise-url"),
])
def test_bad_registration_flags_stop_serve_with_exit_2(flags: list[str], named: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    try:
        status = main(["serve", *flags])
    except SystemExit as exc:           # refused by the parser itself (a value that is not a finite number)
        status = exc.code
    assert status == 2
    assert named in capsys.readouterr().err


def gateway_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    return parser.parse_args(list(flags))


def test_gateway_flags_of_shared_state_and_discovery(capsys: pytest.CaptureFixture[str]) -> None:
    config = build_gateway_config(gateway_args("--discover", "redis://r/2", "--redis-url", "redis://r/3",
                                               "--session-affinity-ttl", "7200", "--discover-interval", "2"))
    assert config.replicas == () and config.discover_url == "redis://r/2" and config.redis_url == "redis://r/3"
    assert (config.affinity_ttl_s, config.discover_interval_s) == (7200, 2.0)
    for flags, named in ((["--discover", "r:6379"], "--discover"),
                         (["--replica", "http://a:1", "--redis-url", "localhost"], "--redis-url"),
                         (["--discover", "redis://r", "--discover-interval", "0"], "--discover-interval"),
                         (["--discover", "redis://r", "--session-affinity-ttl", "0"], "--session-affinity-ttl"),
                         ([], "--discover")):
        assert run_gateway(gateway_args(*flags, "--log-level", "error")) == 2
        assert named in capsys.readouterr().err
