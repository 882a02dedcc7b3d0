"""kvhive on Ray Serve: ``build_app`` (the application), ``KVAwareRequestRouter`` (its request
router), ``KVHiveReplica`` and ``KVHiveIngress`` (its deployments). Needs the ``ray`` extra."""

from __future__ import annotations

from kvhive.integrations.ray.app import build_app
from kvhive.integrations.ray.app_args import ConfigError, parse_app_config

__all__ = ["ConfigError", "build_app", "parse_app_config"]
