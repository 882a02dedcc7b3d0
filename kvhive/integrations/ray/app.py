"""``build_app``: the Ray Serve application (``import_path: kvhive.integrations.ray:build_app``).

Two deployments: ``KVHiveReplica`` (a kvhive engine per replica, routed by
``KVAwareRequestRouter``) and ``KVHiveIngress`` (the OpenAI-compatible HTTP entry). The config is
checked whole before any deployment is declared: an unknown field, a value ``kvhive serve``
refuses, a missing model or a replica bigger than every node of the cluster raises
``ConfigError``, and nothing is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhive.integrations.ray.app_args import ConfigError, RayAppConfig, parse_app_config

DEFAULT_REPLICA_OPTIONS = {"num_cpus": 1}
DEFAULT_INGRESS_OPTIONS = {"num_cpus": 0}
# How long Ray gives a stopping replica (its ongoing requests, then its drain) before killing it.
GRACEFUL_SHUTDOWN_S = 40.0
# Ray's names for a replica's needs, and where a node states its capacity for each.
_NEEDS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def build_app(args: Mapping[str, Any]) -> Any:
    """The application for ``args`` (the config file's ``args``; see ``parse_app_config``)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvhive.integrations.ray.deployment import KVHiveReplica
    from kvhive.integrations.ray.ingress import KVHiveIngress

    config = parse_app_config(args)
    replica_options = {**DEFAULT_REPLICA_OPTIONS, **config.ray_actor_options}
    check_fits(replica_options, "ray_actor_options")
    kwargs = config.router.router_kwargs()
    if config.router.is_kvhive:
        kwargs["salt_with_api_key"] = salts_with_api_key(config)
    router = RequestRouterConfig(request_router_class=config.router.request_router_class,
                                 request_router_kwargs=kwargs,
                                 request_routing_stats_period_s=config.router.routing_stats_period_s)
    scaling: dict[str, Any] = ({"autoscaling_config": dict(config.autoscaling_config)}
                               if config.autoscaling_config is not None else {"num_replicas": config.num_replicas})
    replicas = serve.deployment(KVHiveReplica, name="KVHiveReplica", ray_actor_options=replica_options,
                                max_ongoing_requests=config.max_ongoing_requests, request_router_config=router,
                                health_check_period_s=2.0, health_check_timeout_s=30.0,
                                graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, **scaling)
    ingress_options = {**DEFAULT_INGRESS_OPTIONS, **config.ingress.get("ray_actor_options", {})}
    check_fits(ingress_options, "ingress.ray_actor_options")
    ingress = serve.deployment(serve.ingress()(KVHiveIngress), name="KVHiveIngress",
                               num_replicas=config.ingress.get("num_replicas", 1),
                               max_ongoing_requests=config.ingress.get("max_ongoing_requests", 1000),
                               ray_actor_options=ingress_options)
    engine = config.engine
    return ingress.bind(replicas.bind(list(config.engine_args)), redis_url=engine.store.redis_url,
                        session_ttl_s=engine.sessions.max_ttl_s, max_request_bytes=_max_request_bytes(config))


def salts_with_api_key(config: RayAppConfig) -> bool:
    """Whether replicas salt prompts with the caller's key (API keys given, prefix cache not shared)."""
    return "--api-key" in config.engine_args and not config.engine.sessions.share_prefix_cache


def check_fits(options: Mapping[str, Any], field: str) -> None:
    """``ConfigError`` naming ``field`` when no node of the connected cluster has the CPUs, GPUs,
    memory and custom resources one replica asks for (nothing checked when Ray is not running)."""
    import ray

    if not ray.is_initialized():
        return
    needs = {_NEEDS[k]: float(v) for k, v in options.items() if k in _NEEDS and v}
    needs.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not needs or any(all(node.get(k, 0.0) >= v for k, v in needs.items()) for node in nodes):
        return
    largest = max(nodes, key=lambda n: n.get("CPU", 0.0), default={})
    have = {k: largest.get(k, 0.0) for k in needs}
    raise ConfigError(f"{field}: no node of this Ray cluster can give one replica {needs} "
                      f"(the largest node has {have}); lower the request or add nodes")


def _max_request_bytes(config: RayAppConfig) -> int | None:
    """The ingress's body limit: the replicas' --max-request-bytes where given."""
    args = config.engine_args
    return int(args[args.index("--max-request-bytes") + 1]) if "--max-request-bytes" in args else None
