"""The services a replica's routes serve from, built over its engine and its durable state: the
generation service (with its metrics and its session service) and the Responses API."""

from __future__ import annotations

import logging

from kvhive.core.generation_defaults import SamplingDefaults
from kvhive.engine.client import EngineClient
from kvhive.server.app import AppOptions, AppServices
from kvhive.server.generation import GenerationService
from kvhive.server.metrics import ServerMetrics
from kvhive.server.responses import ResponsesAPI
from kvhive.sessions.backends import SessionBackend
from kvhive.sessions.response_backends import ResponseBackend
from kvhive.sessions.response_store import ResponseStore
from kvhive.sessions.service import SessionService, keeper_tier

logger = logging.getLogger(__name__)


def build_services(engine: EngineClient, options: AppOptions, session_backend: SessionBackend | None,
                   response_backend: ResponseBackend | None, defaults: SamplingDefaults) -> AppServices:
    """The generation service (with its metrics, whose runtime paths and cache config it shows, its
    session service over ``session_backend`` and the sampling ``defaults`` of --generation-config)
    and the Responses API over ``response_backend``."""
    config = engine.config
    metrics = ServerMetrics(engine.stats, config.served_model_name, max_model_len=engine.max_model_len,
                            compat=options.metrics_compat)
    metrics.show_paths(engine.runtime_info())
    metrics.show_cache_config(config)
    sessions = SessionService(config.sessions, engine, block_bytes=engine.block_bytes, block_size=engine.block_size,
                              backend=session_backend, keeper=keeper_tier(engine.keeper_budget(), config.store),
                              device_pool_bytes=config.cache.num_blocks * engine.block_bytes)
    logger.info("sampling defaults for unset request fields (--generation-config %s): %s",
                config.generation_config, defaults.describe())
    service = GenerationService(engine, metrics, config.served_model_name, sessions=sessions,
                                api_keys=options.api_keys, share_prefix_cache=config.sessions.share_prefix_cache,
                                defaults=defaults, tool_call_parser=options.tool_call_parser)
    return AppServices(service, ResponsesAPI(service, ResponseStore(response_backend)))
