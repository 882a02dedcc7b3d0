"""The Ray Serve application's config: ``kvhive serve``'s flags as fields, plus Ray's own.

Engine fields are the ``serve`` flags' names with underscores (``model``, ``dtype``, ``kv_cache_gb``,
``redis_url``, ``max_sessions_per_key``, ``num_threads``, ...). They are turned back into flags and
parsed by the very parser and ``build_engine_config`` that ``kvhive serve`` uses, so a value the
CLI refuses is refused here with the same message. Ray decides where a replica listens and where
it publishes KV events, and its HTTP proxy reads the requests, so the flags of addresses,
registration and HTTP limits are not fields.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvhive.config import EngineConfig
from kvhive.core.flag_values import FlagValueError, flag_argv, option_actions
from kvhive.core.http_limits import BOUNDS, http_dest
from kvhive.routing.scorer import SCORERS, RoutingWeights, TierWeights
from kvhive.serve_args import add_serve_args, build_engine_config

# Serve flags whose job Ray Serve (or this integration) does: not fields.
RAY_DECIDES = MappingProxyType({
    "host": "Ray Serve's HTTP proxy listens for the application (serve's http_options)",
    "port": "Ray Serve's HTTP proxy listens for the application (serve's http_options)",
    "register": "Ray Serve tracks the replicas itself",
    "advertise_url": "Ray Serve tracks the replicas itself",
    "register_ttl": "Ray Serve tracks the replicas itself",
    "kv_events": "each replica publishes KV events on a port of its own node",
    "kv_events_replay": "each replica serves replay on a port of its own node",
    "kv_events_config": "each replica publishes KV events on a port of its own node",
    **dict.fromkeys(("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"),
                    "Ray Serve's HTTP proxy answers the browsers, not kvhive's server (set CORS in front of it)"),
    **dict.fromkeys(map(http_dest, BOUNDS),
                    "Ray Serve's HTTP proxy reads the requests, not kvhive's server (its limits are "
                    "serve's http_options, e.g. keep_alive_timeout_s)"),
})
RAY_FIELDS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
              "ingress", "router")
INGRESS_FIELDS = ("num_replicas", "ray_actor_options", "max_ongoing_requests")
ROUTER_FIELDS = ("scorer", "tier_weights", "routing_weights", "routing_stats_period_s", "index_redis_url",
                 "request_router_class", "request_router_kwargs")
# The replicas' request router unless ``router.request_router_class`` names another one of Ray's.
KVHIVE_ROUTER_CLASS = "kvhive.integrations.ray.router:KVAwareRequestRouter"


class ConfigError(ValueError):
    """A config value the application refuses; the message names the field."""


class _FieldParser(argparse.ArgumentParser):
    """The ``serve`` parser whose errors raise ``ConfigError`` instead of exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise instead of printing usage and exiting."""
        raise ConfigError(message)


def serve_parser() -> argparse.ArgumentParser:
    """A parser with every ``kvhive serve`` flag that raises ``ConfigError`` on a bad value."""
    parser = _FieldParser(prog="kvhive serve", add_help=False)
    add_serve_args(parser)
    return parser


@dataclass(frozen=True)
class RouterSettings:
    """How ``KVAwareRequestRouter`` scores: the KV scorer, tier and routing weights, stats period."""

    scorer: str = "longest_prefix"
    tier_weights: TierWeights = field(default_factory=TierWeights)
    routing_weights: RoutingWeights = field(default_factory=RoutingWeights)
    routing_stats_period_s: float = 1.0
    index_redis_url: str | None = None      # the block index in this Redis (shared by ingress replicas)
    # Another RequestRouter (Ray's, to compare) and its kwargs; the fields above then do nothing.
    request_router_class: str = KVHIVE_ROUTER_CLASS
    request_router_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ConfigError(f"router.scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if not 0 < self.routing_stats_period_s <= 60:
            raise ConfigError(f"router.routing_stats_period_s must be in (0, 60], got {self.routing_stats_period_s}")

    @property
    def is_kvhive(self) -> bool:
        """Whether the replicas are routed by ``KVAwareRequestRouter``."""
        return self.request_router_class == KVHIVE_ROUTER_CLASS

    def router_kwargs(self) -> dict[str, Any]:
        """These settings as JSON-able ``request_router_kwargs``."""
        if not self.is_kvhive:
            return dict(self.request_router_kwargs)
        return {"scorer": self.scorer, "tier_weights": vars(self.tier_weights),
                "routing_weights": vars(self.routing_weights), "index_redis_url": self.index_redis_url}


@dataclass(frozen=True)
class RayAppConfig:
    """A validated application config: the engine's flags (``engine_args``, as argv) and Ray's options."""

    engine_args: tuple[str, ...]
    engine: EngineConfig
    num_replicas: int | str | None = 1
    autoscaling_config: Mapping[str, Any] | None = None
    ray_actor_options: Mapping[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 16
    ingress: Mapping[str, Any] = field(default_factory=dict)
    router: RouterSettings = field(default_factory=RouterSettings)


def parse_app_config(raw: Mapping[str, Any]) -> RayAppConfig:
    """Validate an application's ``args``: every field known, every engine value as ``kvhive serve``
    takes it; ``ConfigError`` naming the field otherwise."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the application's args must be a mapping, got {type(raw).__name__}")
    parser = serve_parser()
    actions = option_actions(parser)
    argv: list[str] = []
    for name, value in raw.items():
        if name in RAY_FIELDS:
            continue
        if name in RAY_DECIDES:
            raise ConfigError(f"field {name!r} is not set in a Ray Serve application: {RAY_DECIDES[name]}")
        if name not in actions:
            raise ConfigError(f"unknown field {name!r} (known: kvhive serve's flags with underscores, "
                              f"e.g. model, dtype, kv_cache_gb, redis_url, num_threads; and {', '.join(RAY_FIELDS)})")
        try:
            argv.extend(flag_argv(actions[name], name, value))
        except FlagValueError as exc:
            raise ConfigError(str(exc)) from None
    args = parser.parse_args(argv)
    try:
        engine = build_engine_config(args)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from exc
    return RayAppConfig(
        engine_args=tuple(argv), engine=engine,
        num_replicas=_replicas(raw.get("num_replicas", None if "autoscaling_config" in raw else 1)),
        autoscaling_config=_mapping(raw, "autoscaling_config"),
        ray_actor_options=_mapping(raw, "ray_actor_options") or {},
        max_ongoing_requests=_positive_int(raw, "max_ongoing_requests", 16),
        ingress=_ingress(raw), router=_router(raw))


def _mapping(raw: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    value = raw.get(name)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"field {name!r} must be a mapping, got {value!r}")
    return dict(value) if value is not None else None


def _positive_int(raw: Mapping[str, Any], name: str, default: int) -> int:
    value = raw.get(name, default)
    if type(value) is not int or value < 1:
        raise ConfigError(f"field {name!r} must be a positive integer, got {value!r}")
    return value


def _replicas(value: Any) -> int | str | None:
    if value is None or value == "auto" or (type(value) is int and 1 <= value <= 1024):
        return value
    raise ConfigError(f"field 'num_replicas' must be an integer in 1..1024 or 'auto', got {value!r}")


def _ingress(raw: Mapping[str, Any]) -> dict[str, Any]:
    section = _mapping(raw, "ingress") or {}
    for name in section:
        if name not in INGRESS_FIELDS:
            raise ConfigError(f"unknown field 'ingress.{name}' (known: {', '.join(INGRESS_FIELDS)})")
    return section


def _router(raw: Mapping[str, Any]) -> RouterSettings:
    section = _mapping(raw, "router") or {}
    for name in section:
        if name not in ROUTER_FIELDS:
            raise ConfigError(f"unknown field 'router.{name}' (known: {', '.join(ROUTER_FIELDS)})")
    try:
        tiers = TierWeights(**(_mapping(section, "tier_weights") or {}))
        weights = RoutingWeights(**(_mapping(section, "routing_weights") or {}))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"router: {exc}") from exc
    redis_url = section.get("index_redis_url")
    if redis_url is not None and not (isinstance(redis_url, str) and redis_url.startswith(("redis://", "rediss://"))):
        raise ConfigError(f"router.index_redis_url must be a redis:// URL, got {redis_url!r}")
    return RouterSettings(section.get("scorer", "longest_prefix"), tiers, weights,
                          float(section.get("routing_stats_period_s", 1.0)), redis_url,
                          _router_class(section.get("request_router_class", KVHIVE_ROUTER_CLASS)),
                          _mapping(section, "request_router_kwargs") or {})


def _router_class(path: Any) -> str:
    """``path`` when it names an importable Ray ``RequestRouter`` ("module:Class" or "module.Class")."""
    if path == KVHIVE_ROUTER_CLASS:
        return path
    if not isinstance(path, str) or not 0 < len(path) <= 300:
        raise ConfigError(f"router.request_router_class must be an import path, got {path!r}")
    module, sep, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    try:
        from ray.serve.request_router import RequestRouter

        found = getattr(importlib.import_module(module), name) if sep else None
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"router.request_router_class {path!r} cannot be imported: {exc}") from exc
    if not (isinstance(found, type) and issubclass(found, RequestRouter)):
        raise ConfigError(f"router.request_router_class {path!r} is not a Ray Serve RequestRouter")
    return path
