"""``KVHiveReplica``: one kvhive engine in a Ray Serve replica, answering with ``kvhive serve``'s
own replica (``kvhive.launch.build_replica``: engine, services, FastAPI app) through ``call_asgi``.

The replica parses its engine flags with ``kvhive serve``'s parser, publishes KV events on a free
port of its node, and states its block geometry, fingerprint and event endpoints in its replica
metadata, which ``KVAwareRequestRouter`` reads. Its routing stats are the engine's running and
waiting requests and KV usage. Its health check fails once the engine loop has died, so Ray
replaces it. When Ray stops it (scale-down, redeploy), it first moves its sessions' KV blocks and
records to the shared tier (``drain_sessions``), where another replica finds them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvhive.integrations.ray.app_args import serve_parser
from kvhive.integrations.ray.asgi_bridge import ResponseHead, call_asgi
from kvhive.integrations.ray.drain import drain_sessions
from kvhive.integrations.ray.envelope import REPLICA_HEADER, HTTPEnvelope
from kvhive.integrations.ray.replica_routing import ReplicaFacts

if TYPE_CHECKING:
    from kvhive.launch.replica import Replica

logger = logging.getLogger(__name__)
# Ray Serve writes this logger to the replica's own log file (others stop at WARNING).
serve_logger = logging.getLogger("ray.serve")

# How long a stopping replica may spend moving its sessions to the shared tier (within Ray's
# graceful_shutdown_timeout_s, GRACEFUL_SHUTDOWN_S in app.py).
DRAIN_TIMEOUT_S = 20.0


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class KVHiveReplica:
    """A kvhive engine and its OpenAI app, in a Ray Serve replica (the deployment's class)."""

    async def __init__(self, engine_args: list[str]) -> None:
        import ray
        from ray import serve

        node_ip = ray.util.get_node_ip_address()
        events, replay = free_port(node_ip), free_port(node_ip)
        # A PUB socket binds only a wildcard endpoint (vLLM's rule); routers connect to the node's address.
        args = serve_parser().parse_args([*engine_args, "--kv-events", f"tcp://*:{events}",
                                          "--kv-events-replay", f"tcp://*:{replay}"])
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.replica = _build_replica(args)
        self.async_engine, self.app = self.replica.engine, self.replica.app
        self.async_engine.start()
        config = self.replica.client.config
        self.facts = ReplicaFacts(config.model_path, config.cache.block_size, config.cache.hash_seed,
                                  self.replica.client.fingerprint, f"tcp://{node_ip}:{events}",
                                  f"tcp://{node_ip}:{replay}")
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        serve_logger.info("kvhive replica %s ready: %s", self.replica_id, self.facts)

    async def handle_http(self, envelope: HTTPEnvelope) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to ``envelope``: its head (naming this replica), then its body's pieces."""
        async for item in call_asgi(self.app, envelope, ((REPLICA_HEADER, self.replica_id),)):
            yield item

    def record_replica_metadata(self) -> dict[str, Any]:
        """What the request router needs to index this replica's KV blocks."""
        return self.facts.as_metadata()

    def record_routing_stats(self) -> dict[str, Any]:
        """The engine's load, for the request router."""
        stats = self.async_engine.stats()
        return {"running": stats.num_running, "waiting": stats.num_waiting, "kv_usage": stats.kv_usage}

    def check_health(self) -> None:
        """Raise once the engine loop has died (Ray then replaces this replica)."""
        if not self.async_engine.is_healthy:
            raise RuntimeError(f"kvhive engine loop stopped: {self.async_engine.error!r}")

    async def __del__(self) -> None:
        """Hand the sessions to the shared tier, then stop the sweepers and the engine (Ray calls
        this when it stops the replica, once its ongoing requests are done)."""
        try:
            report = await asyncio.wait_for(asyncio.to_thread(drain_sessions, self.replica), DRAIN_TIMEOUT_S)
            serve_logger.info("kvhive replica %s drained: %s", self.replica_id, report)
        except Exception:  # noqa: BLE001 - stopping goes on: what reached Redis already stays there
            serve_logger.exception("kvhive replica %s: drain failed", self.replica_id)
        with contextlib.suppress(Exception):
            await self._lifespan.aclose()
        await asyncio.to_thread(self.async_engine.shutdown)


def _build_replica(args: argparse.Namespace) -> Replica:
    """The replica ``args`` (``kvhive serve``'s flags) describe, its config resolved as ``kvhive serve``
    resolves it; its engine loop not started yet."""
    from kvhive.cli import resolve_runtime
    from kvhive.launch.replica import build_replica
    from kvhive.serve_args import build_engine_config
    from kvhive.server.app import AppOptions

    config = resolve_runtime(args, build_engine_config(args))
    options = AppOptions(api_keys=tuple(args.api_key or ()), max_request_bytes=args.max_request_bytes,
                         metrics_compat=args.metrics_compat, tokenizer_info=args.enable_tokenizer_info_endpoint,
                         tool_call_parser=args.tool_call_parser)
    return build_replica(config, options)
