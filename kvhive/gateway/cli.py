"""``kvhive gateway`` flags and entry point (``kvhive/cli.py`` adds the subcommand)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvhive.core.cors import add_cors_args, cors_from_args
from kvhive.core.flag_values import finite_float
from kvhive.core.http_limits import add_http_limit_args, http_limits_from_args
from kvhive.gateway.gateway_config import ROUTING_POLICIES, GatewayConfig, ReplicaSpec
from kvhive.gateway.outlier import OutlierPolicy
from kvhive.routing.scorer import SCORERS, RoutingWeights, TierWeights, weight_problem

logger = logging.getLogger(__name__)


GATEWAY_DESCRIPTION = """\
An OpenAI-compatible proxy in front of several replicas (kvhive serve, or vLLM). It keeps a global
index of which replica holds which KV blocks, fed by the replicas' KV events (in memory, or in Redis
shared by several gateways), and sends each request to the replica holding the longest cached prefix
of its prompt, weighed against load; sessions stick to their replica. It does not import torch. The
port is checked first: a taken port exits with status 2."""

GATEWAY_EPILOG = """\
examples:
  kvhive serve --port 8001 --kv-events 'tcp://*:5557' --kv-events-replay 'tcp://*:5558' &
  kvhive serve --port 8002 --kv-events 'tcp://*:5567' --kv-events-replay 'tcp://*:5568' &
  # once both answer /health (the gateway reads their block-hash settings at start):
  kvhive gateway --port 8080 \\
    --replica 'http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558' \\
    --replica 'http://127.0.0.1:8002,events=tcp://127.0.0.1:5567,replay=tcp://127.0.0.1:5568'
  # replicas that register themselves, behind two gateways that share sessions and the index:
  kvhive serve --port 8001 --kv-events 'tcp://*:5557' --register redis://127.0.0.1:6379/0 &
  kvhive gateway --port 8080 --discover redis://127.0.0.1:6379/0 --redis-url redis://127.0.0.1:6379/0 &
  kvhive gateway --port 8081 --discover redis://127.0.0.1:6379/0 --redis-url redis://127.0.0.1:6379/0"""


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """Add the ``gateway`` flags to ``p``, in argument groups (the logging group is ``serve``'s)."""
    from kvhive.serve_args import add_logging_args

    _add_replica_args(p)
    _add_block_key_args(p)
    _add_index_args(p)
    _add_routing_args(p)
    _add_upstream_args(p)
    _add_server_args(p)
    add_http_limit_args(p)
    add_logging_args(p)


def _add_replica_args(p: argparse.ArgumentParser) -> None:
    """Add the "replicas" group to ``p``: each replica, the key its settings are read with, health checks."""
    g = p.add_argument_group("replicas")
    g.add_argument("--replica", action="append", default=[], metavar="URL[,events=..][,replay=..][,kind=..]",
                   help="a replica: base URL, optionally its KV-event PUB endpoint (events=tcp://host:5557), "
                        "replay endpoint (replay=tcp://host:5558) and engine (kind=kvhive|vllm); repeat "
                        "for each replica (default: none; at least one is needed, or --discover)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL[,events=..][,..]",
                   help="a prefill replica (kvhive serve --kv-role prefill): prompts without a session "
                        "are computed on the best-scoring one, then continued on a --decode replica "
                        "(docs/disaggregation.md) (default: none)")
    g.add_argument("--decode", action="append", default=[], metavar="URL,kv=HOST:PORT[,events=..][,..]",
                   help="a decode replica (kvhive serve --kv-role decode) and its KV transfer endpoint "
                        "(its --kv-transfer-port); answers, streams and sessions come from these "
                        "(default: none)")
    g.add_argument("--replica-api-key", default=None, metavar="KEY",
                   help="key the gateway sends to replicas started with --api-key when it reads their "
                        "block-hash settings from /v1/models at start (default: $KVHIVE_API_KEY, else none)")
    g.add_argument("--health-interval", type=finite_float, default=1.0, metavar="S",
                   help="seconds between health checks")
    g.add_argument("--failures-to-drop", type=int, default=2, metavar="N",
                   help="failed health checks in a row that drop a replica")


def _add_block_key_args(p: argparse.ArgumentParser) -> None:
    """Add the "block keys" group to ``p``: the tokenizer, block size, hash seed, fingerprint and salt
    that make the replicas' block keys."""
    g = p.add_argument_group("block keys (how the replicas name their KV blocks)")
    g.add_argument("--model", default=None,
                   help="GGUF file or HF directory whose tokenizer the replicas use (default: the "
                        "embedded SmolLM2-135M-Instruct GGUF)")
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV block (default: 'kvhive_block_size' of a kvhive replica's "
                        "/v1/models entry, else 16)")
    g.add_argument("--hash-seed", type=int, default=None, metavar="N",
                   help="block-hash seed (default: 'kvhive_hash_seed' of a kvhive replica's /v1/models "
                        "entry, else 0)")
    g.add_argument("--model-fingerprint", default=None, metavar="HEX",
                   help="the replicas' model fingerprint (default: the 'kvhive_fingerprint' field of a "
                        "kvhive replica's /v1/models entry, else empty)")
    g.add_argument("--salt-with-api-key", action="store_true",
                   help="the replicas run with --api-key and without --share-prefix-cache, so each API "
                        "key has its own prefix cache: salt each prompt's block keys with the caller's "
                        "key as they do; without it, KV routing to such replicas falls back to load "
                        "(default: off)")


def _add_index_args(p: argparse.ArgumentParser) -> None:
    """Add the "shared state" group to ``p``: the Redis several gateways share (block index and
    session affinity), the bound of the in-memory index, and replica discovery."""
    g = p.add_argument_group("block index, session affinity and discovery (shared by gateways)")
    g.add_argument("--redis-url", default=None, metavar="URL",
                   help="keep the block index and which replica holds each session or stored response "
                        "in Redis, shared by every gateway given the same URL; while it is unreachable "
                        "each gateway routes by its own session map and by load (default: in memory)")
    g.add_argument("--session-affinity-ttl", type=int, default=86400, metavar="S",
                   help="seconds a shared session-affinity entry lives after its last use; give at least "
                        "the replicas' --max-session-ttl")
    g.add_argument("--index-max-keys", type=int, default=1_000_000, metavar="N",
                   help="bound of the in-memory index (LRU beyond it)")
    g.add_argument("--discover", default=None, metavar="URL",
                   help="also route to the replicas registered in this Redis (kvhive serve --register URL), "
                        "beside any --replica; one whose heartbeat stops is removed within its "
                        "--register-ttl plus --discover-interval (default: off)")
    g.add_argument("--discover-interval", type=finite_float, default=1.0, metavar="S",
                   help="seconds between two reads of the replica registry")


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """Add the "routing and scoring" group to ``p``: the policy, the scorer and the score's weights."""
    g = p.add_argument_group("routing and scoring")
    g.add_argument("--policy", choices=ROUTING_POLICIES, default="kv",
                   help="kv: KV score and load (kvhive's routing); least_load, round_robin, random: "
                        "baselines that ignore the KV index (sessions still stick)")
    g.add_argument("--scorer", choices=sorted(SCORERS), default="longest_prefix",
                   help="how KV hits become a score")
    g.add_argument("--tier-weights", default="GPU=1.0,CPU=0.8,DISK=0.5,REMOTE=0.3", metavar="TIER=W,...",
                   help="worth of a cached block by tier, each in [0, 1]")
    g.add_argument("--cache-weight", type=finite_float, default=1.0, metavar="W",
                   help="weight of the cached share of the prompt in the final score")
    g.add_argument("--load-weight", type=finite_float, default=0.5, metavar="W",
                   help="weight of the relative queue length (running + waiting-factor * waiting)")
    g.add_argument("--kv-usage-weight", type=finite_float, default=0.1, metavar="W", help="weight of KV pool usage")
    g.add_argument("--waiting-factor", type=finite_float, default=2.0, metavar="F",
                   help="a waiting request counts as this many running ones")
    g.add_argument("--min-cached-share", type=finite_float, default=0.1, metavar="S",
                   help="a replica holding less than this share of the prompt counts as holding none "
                        "(so a common chat template does not draw every new prompt to one replica)")
    g.add_argument("--cache-key-weight", type=finite_float, default=0.4, metavar="W",
                   help="bonus of the replica that served a request's prompt_cache_key last (per API "
                        "key): same key, same replica while its load allows (0: the key routes nothing)")


def _add_upstream_args(p: argparse.ArgumentParser) -> None:
    """Add the "upstream time limits and outlier ejection" group to ``p``."""
    g = p.add_argument_group("upstream time limits, outlier ejection, KV-event watch")
    g.add_argument("--request-timeout", type=finite_float, default=600.0, metavar="S",
                   help="longest a forwarded request may take: the whole of an answer of known length "
                        "(a non-streamed completion), or a streamed answer's start and first piece, then "
                        "each gap between pieces; past it the request fails (504, or a cut stream) and "
                        "counts against the replica (0: no limit)")
    g.add_argument("--connect-timeout", type=finite_float, default=5.0, metavar="S",
                   help="longest wait for a connection to a replica (the request then goes to another)")
    g.add_argument("--outlier-consecutive-failures", type=int, default=5, metavar="N",
                   help="failed requests in a row (5xx, refused or reset connection, timeout, an answer "
                        "that is not HTTP or not the JSON or event stream expected, a cut body) that eject "
                        "a replica (0: never eject)")
    g.add_argument("--outlier-base-ejection-s", type=finite_float, default=30.0, metavar="S",
                   help="an ejection lasts this times the replica's ejections in a row")
    g.add_argument("--outlier-max-ejection-s", type=finite_float, default=300.0, metavar="S",
                   help="the longest an ejection lasts")
    g.add_argument("--events-silent-after", type=finite_float, default=30.0, metavar="S",
                   help="warn (once, and in /health) when no KV event came from a replica's events= "
                        "endpoint this long after a request was routed to it")


def upstream_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GatewayConfig fields of the ``_add_upstream_args`` flags (ValueError naming a bad one)."""
    return {"request_timeout_s": args.request_timeout, "connect_timeout_s": args.connect_timeout,
            "outliers": OutlierPolicy(args.outlier_consecutive_failures, args.outlier_base_ejection_s,
                                      args.outlier_max_ejection_s),
            "events_silent_after_s": args.events_silent_after}


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Add the "server" group to ``p``: the address to listen on, the largest body read and CORS."""
    from kvhive.serve_args import port_number

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=port_number, default=8080, help="TCP port to listen on")
    g.add_argument("--max-request-bytes", type=int, default=32 * 2**20, metavar="N",
                   help="largest request body in bytes the gateway reads (it holds each body in memory "
                        "to forward it); a larger one is refused with 413 (default: 32 MiB)")
    g.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the key the live page (/dashboard and its data) needs, as 'Authorization: Bearer "
                        "KEY' or as HTTP Basic auth's password, which a browser asks for (401 without it); "
                        "without this flag the page and its data are open to anyone who reaches the gateway "
                        "(default: none)")
    g.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="do not serve the live page (GET /dashboard and /dashboard/data answer 404) "
                        "(default: served)")
    add_cors_args(g)


def parse_tier_weights(text: str) -> TierWeights:
    """``GPU=1,CPU=0.8,...`` as TierWeights (tiers left out keep their defaults)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip().lower() not in ("gpu", "cpu", "disk", "remote"):
            raise ValueError(f"--tier-weights: {part!r} is not TIER=WEIGHT (TIER: GPU, CPU, DISK, REMOTE)")
        try:
            values[name.strip().lower()] = float(value)
        except ValueError as exc:
            raise ValueError(f"--tier-weights: {value!r} is not a number") from exc
    return TierWeights(**values)


# The flag that sets each RoutingWeights field (its errors name the flag).
WEIGHT_FLAGS = {"cache": "--cache-weight", "load": "--load-weight", "kv_usage": "--kv-usage-weight",
                "waiting_factor": "--waiting-factor", "min_share": "--min-cached-share",
                "cache_key": "--cache-key-weight"}


def routing_weights(args: argparse.Namespace) -> RoutingWeights:
    """The scoring weights from their flags; ValueError naming the flag of a value out of range."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in WEIGHT_FLAGS.items()}
    for name, value in values.items():
        problem = weight_problem(name, value)
        if problem is not None:
            raise ValueError(f"{WEIGHT_FLAGS[name]} {problem}")
    return RoutingWeights(**values)


def build_gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """Parsed ``gateway`` flags as a validated GatewayConfig (the fingerprint may still be None)."""
    return GatewayConfig(
        replicas=tuple(ReplicaSpec.parse(r) for r in args.replica)
        + tuple(ReplicaSpec.parse(r, "prefill") for r in args.prefill)
        + tuple(ReplicaSpec.parse(r, "decode") for r in args.decode), host=args.host, port=args.port,
        redis_url=args.redis_url, affinity_ttl_s=args.session_affinity_ttl,
        discover_url=args.discover, discover_interval_s=args.discover_interval,
        index_max_keys=args.index_max_keys, model_path=args.model,
        block_size=16 if args.block_size is None else args.block_size,
        hash_seed=0 if args.hash_seed is None else args.hash_seed,
        model_fingerprint=args.model_fingerprint or "", scorer=args.scorer, policy=args.policy,
        tiers=parse_tier_weights(args.tier_weights),
        weights=routing_weights(args),
        health_interval_s=args.health_interval, failures_to_drop=args.failures_to_drop,
        salt_with_api_key=args.salt_with_api_key, max_request_bytes=args.max_request_bytes,
        http=http_limits_from_args(args),
        **upstream_settings(args))


@dataclass(frozen=True)
class ReplicaHashing:
    """How a kvhive replica names its blocks, from its /v1/models entry (None: not reported)."""

    fingerprint: str | None = None
    block_size: int | None = None
    hash_seed: int | None = None


def fetch_hashing(replicas: tuple[ReplicaSpec, ...], wait_s: float = 10.0,
                  api_key: str | None = None) -> ReplicaHashing:
    """``kvhive_fingerprint``, ``kvhive_block_size`` and ``kvhive_hash_seed`` from the first kvhive
    replica's /v1/models that answers (sending ``api_key`` as a bearer token); all None when no
    replica answers within ``wait_s`` or one refuses the key."""
    urls = [r.url for r in replicas if r.kind == "kvhive"]
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    while urls and time.monotonic() < deadline:
        for url in urls:
            try:
                response = httpx.get(f"{url}/v1/models", headers=headers, timeout=2.0)
            except httpx.HTTPError:
                continue
            if response.status_code == 401:
                logger.warning("%s/v1/models refused the gateway (401): give --replica-api-key (or "
                               "--model-fingerprint, --block-size, --hash-seed)", url)
                return ReplicaHashing()
            if response.status_code != 200:
                continue
            try:
                first = (response.json().get("data") or [{}])[0]
            except (ValueError, AttributeError, TypeError):
                return ReplicaHashing()
            if not isinstance(first, dict):
                return ReplicaHashing()
            return ReplicaHashing(_typed(first, "kvhive_fingerprint", str),
                                  _typed(first, "kvhive_block_size", int),
                                  _typed(first, "kvhive_hash_seed", int))
        time.sleep(0.5)
    return ReplicaHashing()


def _typed(entry: dict[str, Any], name: str, kind: type) -> Any:
    value = entry.get(name)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def fetch_fingerprint(replicas: tuple[ReplicaSpec, ...], wait_s: float = 10.0,
                      api_key: str | None = None) -> str | None:
    """``kvhive_fingerprint`` of the first kvhive replica that answers (see ``fetch_hashing``)."""
    return fetch_hashing(replicas, wait_s, api_key).fingerprint


def run_gateway(args: argparse.Namespace) -> int:
    """Serve the gateway until interrupted; 2 on bad flags."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_gateway_config(args)
        cors = cors_from_args(args)
    except ValueError as exc:
        print(f"kvhive gateway: {exc}", file=sys.stderr)
        return 2
    from kvhive.cli import listen_error
    from kvhive.core.redis_check import redis_refusal

    problem = listen_error(config.host, config.port)      # before waiting on replicas and the tokenizer
    for flag, url in (("--redis-url", config.redis_url), ("--discover", config.discover_url)):
        if problem is None and url is not None:
            problem = redis_refusal(url, flag)
    if problem is not None:
        print(f"kvhive gateway: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from kvhive.core.dashboard_data import DashboardAccess
    from kvhive.core.http_protocol import uvicorn_options
    from kvhive.core.model_files import default_model_path
    from kvhive.core.tokenizer import Tokenizer
    from kvhive.gateway.app import create_gateway_app

    if None in (args.model_fingerprint, args.block_size, args.hash_seed):
        config = with_replica_hashing(config, args)
    tokenizer = Tokenizer.from_model_path(config.model_path or default_model_path())
    app = create_gateway_app(config, tokenizer, cors=cors,
                             dashboard=DashboardAccess(args.dashboard, admin_key=args.admin_key or None))
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, **uvicorn_options(config.http))
    return 0


def with_replica_hashing(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """``config`` with the fingerprint, block size and hash seed that no flag gave read from a kvhive
    replica (``fetch_hashing``); a fingerprint no replica reports is empty, with a warning."""
    learned = fetch_hashing(config.replicas + discovered_replicas(config),
                            api_key=args.replica_api_key or os.environ.get("KVHIVE_API_KEY"))
    if args.model_fingerprint is None:
        if learned.fingerprint is None:
            logger.warning("no --model-fingerprint and no replica reports 'kvhive_fingerprint': "
                           "block keys of kvhive replicas (which include their model fingerprint) "
                           "will not match, so KV-aware routing to them falls back to load")
        config = dataclasses.replace(config, model_fingerprint=learned.fingerprint or "")
    if args.block_size is None and learned.block_size is not None:
        config = dataclasses.replace(config, block_size=learned.block_size)
    if args.hash_seed is None and learned.hash_seed is not None:
        config = dataclasses.replace(config, hash_seed=learned.hash_seed)
    logger.info("block keys: fingerprint %r, block size %d, hash seed %d",
                config.model_fingerprint, config.block_size, config.hash_seed)
    return config


def discovered_replicas(config: GatewayConfig) -> tuple[ReplicaSpec, ...]:
    """With --discover, the replicas registered now (waiting a while for a first one when no
    --replica is given), to read block-hash settings from; else ()."""
    if config.discover_url is None:
        return ()
    from kvhive.gateway.discovery import registered_specs
    from kvhive.routing.redis_link import RedisLink

    link = RedisLink(config.discover_url, timeout_s=1.0, fallback="no replica registered yet")
    try:
        return registered_specs(link, wait_s=0.0 if config.replicas else 10.0)
    finally:
        link.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvhive.gateway.cli``: the gateway without the ``kvhive`` console script."""
    from kvhive.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="kvhive gateway", description=GATEWAY_DESCRIPTION,
                                     epilog=GATEWAY_EPILOG, formatter_class=HelpFormatter)
    add_gateway_args(parser)
    return run_gateway(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
