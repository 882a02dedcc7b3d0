"""The gateway without processes: replica flags, its config, replica load from Prometheus text,
and replica errors in OpenAI's shape."""

from __future__ import annotations

import argparse
import json

import pytest

from kvhive.gateway.cli import add_gateway_args, build_gateway_config, parse_tier_weights, run_gateway
from kvhive.gateway.gateway_config import ReplicaSpec
from kvhive.gateway.replicas import parse_load
from kvhive.routing.dialects import as_openai_error
from kvhive.routing.scorer import LoadStats


def test_replica_flags_and_gateway_config() -> None:
    spec = ReplicaSpec.parse("http://h:8000/,events=tcp://h:5557,replay=tcp://h:5558,kind=vllm")
    assert spec == ReplicaSpec("http://h:8000", "tcp://h:5557", "tcp://h:5558", "vllm")
    assert ReplicaSpec.parse("http://h:1").events is None
    for bad in ("h:1", "http://h:1,kind=sglang", "http://h:1,port=2", "http://h:1,replay=tcp://h:2"):
        with pytest.raises(ValueError):
            ReplicaSpec.parse(bad)
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args(["--replica", "http://a:1", "--replica", "http://b:1,kind=vllm",
                              "--tier-weights", "CPU=0.5", "--load-weight", "0.25", "--scorer", "coverage"])
    config = build_gateway_config(args)
    assert [r.kind for r in config.replicas] == ["kvhive", "vllm"]
    assert config.tiers.cpu == 0.5 and config.tiers.gpu == 1.0 and config.weights.load == 0.25
    assert not config.salt_with_api_key
    assert build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--salt-with-api-key"])) \
        .salt_with_api_key
    with pytest.raises(ValueError):
        build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--replica", "http://a:1"]))
    with pytest.raises(ValueError):
        parse_tier_weights("GPU=x")
    assert run_gateway(parser.parse_args([])) == 2          # no replica: a clear error, no traceback
    assert build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--min-cached-share", "0.2"])) \
        .weights.min_share == 0.2
    assert build_gateway_config(parser.parse_args(["--replica", "http://a:1", "--cache-key-weight", "0"])) \
        .weights.cache_key == 0.0
    for flag, value in (("--min-cached-share", "1.5"), ("--load-weight", "-1"), ("--waiting-factor", "-2"),
                        ("--cache-key-weight", "-0.1")):
        with pytest.raises(ValueError, match=f"^{flag} must be"):
            build_gateway_config(parser.parse_args(["--replica", "http://a:1", flag, value]))


def test_load_from_prometheus_text_and_error_shapes() -> None:
    text = ('# HELP kvhive_num_requests_running x\nkvhive_num_requests_running{model_name="m"} 2.0\n'
            'kvhive_num_requests_waiting{model_name="m"} 1\nkvhive_kv_cache_usage_perc{model_name="m"} 0.5\n'
            'vllm:num_requests_running{model_name="v",engine="0"} 3\nvllm:kv_cache_usage_perc 0.75\n')
    assert parse_load(text) == LoadStats(running=5.0, waiting=1.0, kv_usage=0.75)
    assert parse_load("garbage\n") == LoadStats()
    shaped = {"error": {"message": "m", "type": "t", "param": None, "code": None}}
    assert as_openai_error(400, json.dumps(shaped).encode()) == shaped
    vllm_flat = b'{"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}'
    flat = as_openai_error(400, vllm_flat)
    assert flat["error"]["message"] == "bad" and flat["error"]["code"] == 400
    assert as_openai_error(502, b"upstream exploded")["error"] == {
        "message": "upstream exploded", "type": "server_error", "param": None, "code": None}
    assert as_openai_error(500, b"")["error"]["message"] == "replica answered HTTP 500"
