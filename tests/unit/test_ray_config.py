"""The Ray Serve application's config: ``kvhive serve``'s flags as fields, refused as the CLI refuses
them, with the field named; nothing is declared for a config that fails."""

from __future__ import annotations

import pytest

from kvhive.integrations.ray.app_args import ConfigError, parse_app_config


def test_engine_fields_become_serve_flags_and_ray_fields_stay_ray_s() -> None:
    config = parse_app_config({"num_threads": 1, "kv_cache_gb": 0.25, "enable_prefix_caching": True,
                               "share_prefix_cache": True, "max_sessions_per_key": 3, "num_replicas": 2,
                               "ray_actor_options": {"num_cpus": 1}, "router": {"scorer": "coverage"}})
    assert config.engine.num_threads == 1
    assert config.engine.sessions.max_sessions_per_key == 3
    assert config.engine.sessions.share_prefix_cache is True
    assert config.engine.cache.enable_prefix_caching is True
    assert config.num_replicas == 2 and config.ray_actor_options == {"num_cpus": 1}
    assert config.router.router_kwargs()["scorer"] == "coverage"
    assert parse_app_config({"enable_prefix_caching": False}).engine.cache.enable_prefix_caching is False
    assert parse_app_config({"enable_tokenizer_info_endpoint": True}).engine_args == ("--enable-tokenizer-info-endpoint",)


def test_autoscaling_leaves_the_replica_count_to_ray() -> None:
    config = parse_app_config({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    assert config.num_replicas is None and config.autoscaling_config == {"min_replicas": 1, "max_replicas": 3}


@pytest.mark.parametrize(("raw", "named"), [
    ({"modle": "x.gguf"}, "unknown field 'modle'"),
    ({"model": "/nonexistent/model.gguf"}, "/nonexistent/model.gguf"),
    ({"dtype": "int3"}, "--dtype"),
    ({"num_threads": "many"}, "--num-threads"),
    ({"port": 8000}, "field 'port'"),
    ({"kv_events": "tcp://*:5557"}, "field 'kv_events'"),
    ({"http_header_timeout": 5}, "field 'http_header_timeout' is not set in a Ray Serve application"),
    ({"allowed_origins": ["*"]}, "field 'allowed_origins' is not set in a Ray Serve application"),
    ({"config": "serve.yaml"}, "unknown field 'config'"),
    ({"share_prefix_cache": "yes"}, "field 'share_prefix_cache'"),
    ({"num_replicas": 0}, "field 'num_replicas'"),
    ({"max_ongoing_requests": -1}, "field 'max_ongoing_requests'"),
    ({"ray_actor_options": 3}, "field 'ray_actor_options'"),
    ({"router": {"scorer": "best"}}, "router.scorer"),
    ({"router": {"index_redis_url": "localhost:6379"}}, "router.index_redis_url"),
    ({"router": {"weights": {}}}, "router.weights"),
    ({"router": {"tier_weights": {"gpu": 2.0}}}, "tier weight gpu"),
    ({"ingress": {"replicas": 2}}, "ingress.replicas"),
    ({"router": {"request_router_class": "no.such.module:Router"}}, "router.request_router_class"),
])
def test_a_bad_field_is_refused_with_its_name(raw: dict, named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_app_config(raw)
    assert named in str(refused.value)


def test_build_app_refuses_before_declaring_any_deployment() -> None:
    pytest.importorskip("ray.serve")
    from kvhive.integrations.ray import build_app

    with pytest.raises(ConfigError, match="unknown field 'num_thread'"):
        build_app({"num_thread": 1})


def test_another_ray_request_router_takes_its_own_kwargs() -> None:
    pytest.importorskip("ray.serve")
    path = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
    config = parse_app_config({"router": {"request_router_class": path, "request_router_kwargs": {"k": 1}}})
    assert config.router.request_router_class == path and not config.router.is_kvhive
    assert config.router.router_kwargs() == {"k": 1}
    assert parse_app_config({}).router.is_kvhive
    with pytest.raises(ConfigError, match="not a Ray Serve RequestRouter"):
        parse_app_config({"router": {"request_router_class": "kvhive.integrations.ray.app_args:ConfigError"}})
