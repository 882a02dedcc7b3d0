"""--kv-events-config: vLLM's KVEventsConfig keys, kvhive's encoding/hash_format, the topic template."""

from __future__ import annotations

import pytest

from kvhive.config import EngineConfig
from kvhive.core.kv_events_config import KVEventsConfig, advertised_host, parse_kv_events_config


def test_vllm_keys_and_kvhive_keys_parse_into_one_config() -> None:
    config = parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
        '"replay_endpoint": "tcp://*:6001", "buffer_steps": 50, "hwm": 1000, "max_queue_size": 20, '
        '"topic": "kv@{host}@{model}", "encoding": "array", "hash_format": "int64", "data_parallel_rank": 2}')
    assert config == KVEventsConfig(True, "zmq", "tcp://*:6000", "tcp://*:6001", 50, 1000, 20,
                                    "kv@{host}@{model}", "array", "int64", 2)
    assert config.active and not config.as_map and config.int_hashes


def test_defaults_follow_vllm_and_map_is_the_default_encoding() -> None:
    config = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (config.endpoint, config.replay_endpoint, config.topic, config.buffer_steps) == \
        ("tcp://*:5557", None, "", 10_000)
    assert config.encoding == "map" and config.hash_format == "bytes" and config.data_parallel_rank == 0
    assert config.active


@pytest.mark.parametrize("text", ['{}', '{"enable_kv_cache_events": false, "publisher": "zmq"}',
                                  '{"enable_kv_cache_events": true, "publisher": "null"}'])
def test_events_flow_only_when_enabled_on_the_zmq_publisher(text: str) -> None:
    assert not parse_kv_events_config(text).active


def test_short_forms_are_the_endpoint_and_turn_events_on() -> None:
    assert parse_kv_events_config(None) is None
    short = parse_kv_events_config(None, "tcp://*:7000", "tcp://*:7001")
    assert short.active and short.endpoint == "tcp://*:7000" and short.replay_endpoint == "tcp://*:7001"
    merged = parse_kv_events_config('{"topic": "kv@{host}@{model}", "encoding": "array"}', "tcp://*:7000")
    assert merged.active and merged.endpoint == "tcp://*:7000" and merged.encoding == "array"
    with pytest.raises(ValueError, match="--kv-events and --kv-events-config's endpoint"):
        parse_kv_events_config('{"endpoint": "tcp://*:1"}', "tcp://*:2")
    with pytest.raises(ValueError, match="--kv-events-replay needs --kv-events"):
        parse_kv_events_config(None, None, "tcp://*:7001")


@pytest.mark.parametrize("text,named", [
    ('{"enable_kv_cache_events": true, "colour": "red"}', "unknown key 'colour'"),
    ('{"host": "10.0.0.1"}', "unknown key 'host'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be a boolean"),
    ('{"buffer_steps": 1.5}', "buffer_steps must be an integer"),
    ('{"hwm": true}', "hwm must be an integer"),
    ('{"topic": 7}', "topic must be a string"),
    ('{"replay_endpoint": []}', "replay_endpoint must be a string or null"),
    ('{"encoding": "json"}', "encoding must be one of map, array, got 'json'"),
    ('{"hash_format": "int32"}', "hash_format must be one of bytes, int64"),
    ('{"publisher": "kafka"}', "publisher must be one of zmq, null"),
    ('{"topic": "kv@{pod_ip}@{model}"}', r"topic placeholder \{pod_ip\} is unknown"),
    ('{"topic": "kv@{host:>20}"}', r"topic placeholder \{host:>20\} is unknown"),
    ('{"topic": "kv@{}"}', r"topic placeholder \{\} is unknown"),
    ('{"topic": "kv@{host"}', "is not a valid template"),
    ('{"endpoint": "http://x:1"}', "endpoint must be a ZMQ endpoint"),
    ('{"max_queue_size": 0}', r"max_queue_size must be in \[1, "),
    ('{"data_parallel_rank": -1}', "data_parallel_rank must be in"),
    ('{"enable_kv_cache_events": true', "not valid JSON"),
    ('["enable_kv_cache_events"]', "must be a JSON object, got list"),
])
def test_bad_config_is_a_value_error_naming_what_is_wrong(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_kv_events_config(text)


def test_topic_template_renders_host_port_model_and_rank() -> None:
    config = parse_kv_events_config('{"topic": "kv@{host}:{port}@{model}#{rank}{{x}}", '
                                    '"data_parallel_rank": 3}').for_server("10.1.2.3", 8001)
    assert config.rendered_topic("smollm2-135m") == "kv@10.1.2.3:8001@smollm2-135m#3{x}"


def test_a_wildcard_listen_address_is_replaced_by_this_machines_address() -> None:
    assert advertised_host("10.0.0.7") == "10.0.0.7"
    host = advertised_host("0.0.0.0")
    assert host and host != "0.0.0.0"
    config = KVEventsConfig(topic="kv@{host}@{model}").for_server("0.0.0.0", 9000)
    assert config.host == host and config.rendered_topic("m") == f"kv@{host}@m"


def test_engine_config_takes_the_short_form_or_the_config_never_both() -> None:
    assert EngineConfig("m").kv_events_settings() is None
    short = EngineConfig("m", kv_events="tcp://*:5557", kv_events_replay="tcp://*:5558").kv_events_settings()
    assert short == KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    full = KVEventsConfig(True, topic="kv@{host}@{model}")
    assert EngineConfig("m", kv_events_config=full).kv_events_settings() is full
    with pytest.raises(ValueError, match="give the KV-event endpoint once"):
        EngineConfig("m", kv_events="tcp://*:5557", kv_events_config=full)
