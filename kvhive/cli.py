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
from collections.abc import Mapping

from kvhive.config import CPU_ISAS, EngineConfig
from kvhive.core.cors import cors_from_args
from kvhive.core.flag_values import FlagValueError, given_dests, load_flag_file, mapping_argv
from kvhive.core.http_limits import http_limits_from_args
from kvhive.core.redis_check import redis_refusal
from kvhive.core.replica_registry import RegistrationConfig
from kvhive.serve_args import AUTO_SPIN_COUNT, add_serve_args, build_engine_config, build_registration


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
        config = grammar_mask_from_env(build_engine_config(args), os.environ)
        registration = build_registration(args)
        cors_from_args(args)
    except ValueError as exc:
        print(f"kvhive serve: {exc}", file=sys.stderr)
        return 2
    problem = listen_error(args.host, args.port)      # before the model loads, which takes a while
    if problem is None:
        problem = redis_refusals(config, registration)
    if problem is None:
        try:
            config = resolve_runtime(args, config)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        print(f"kvhive serve: {problem}", file=sys.stderr)
        return 2
    return run_engine(args, config, registration)


def grammar_mask_from_env(config: EngineConfig, environ: Mapping[str, str]) -> EngineConfig:
    """``config`` with the token masks of structured outputs computed after the forward pass (not
    during it) when ``KVHIVE_GRAMMAR_MASK_SYNC=1`` is set; ValueError for another value."""
    value = environ.get("KVHIVE_GRAMMAR_MASK_SYNC", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"KVHIVE_GRAMMAR_MASK_SYNC must be 0 or 1, got {value!r}")
    return dataclasses.replace(config, grammar_mask_overlap=False) if value == "1" else config


def redis_refusals(config: EngineConfig, registration: RegistrationConfig | None) -> str | None:
    """Why a Redis that ``--redis-url`` or ``--register`` names refuses this replica (a wrong
    password, a missing database), or None; an unreachable Redis is a runtime fault, not this."""
    urls = [("--redis-url", config.store.redis_url)]
    if registration is not None:
        urls.append(("--register", registration.redis_url))
    for flag, url in urls:
        if url is not None and (problem := redis_refusal(url, flag)) is not None:
            return problem
    return None


def resolve_auto_dtype(config: EngineConfig) -> EngineConfig:
    """``config`` with ``--dtype auto`` replaced by the dtype the checkpoint runs in here (logged;
    imports torch, so call it after ``prepare_runtime``)."""
    from kvhive.model.auto_dtype import choose_dtype

    dummy = (config.hf_config_path or config.model_path) if config.load_format == "dummy" else None
    choice = choose_dtype(config.model_path, config.device, config.cpu_isa, dummy)
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


def resolve_runtime(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """Prepare this process to run ``config`` (``prepare_runtime``) and resolve ``--dtype auto``:
    the config ``build_replica`` takes; ValueError naming what this CPU or CUDA cannot run."""
    problem = prepare_runtime(args, config)
    if problem is not None:
        raise ValueError(problem)
    if config.load_format == "dummy":        # the config and tokenizer, before the server stack loads
        from kvhive.model.dummy_weights import check_dummy_sources

        check_dummy_sources(config.model_path, config.hf_config_path)
    return resolve_auto_dtype(config) if config.dtype == "auto" else config


def run_engine(args: argparse.Namespace, config: EngineConfig,
               registration: RegistrationConfig | None = None) -> int:
    """Build the engine and serve HTTP over it until interrupted: 0 after a clean shutdown, 1 when
    the server never started or the engine loop died, 2 for a model or config the engine cannot run.
    The API keys are --api-key, else $KVHIVE_API_KEY, and --admin-key. With ``registration``, the replica keeps its
    record in the registry while it serves and deregisters when it stops."""
    from kvhive.launch.replica import EngineRefused, build_replica
    from kvhive.server.app import AppOptions, run_server

    api_keys = args.api_key or ([os.environ["KVHIVE_API_KEY"]] if os.environ.get("KVHIVE_API_KEY")
                                else [])
    if args.admin_key and args.admin_key not in api_keys:
        api_keys.append(args.admin_key)          # the admin key is an API key too
    options = AppOptions(api_keys=tuple(api_keys), max_request_bytes=args.max_request_bytes,
                         metrics_compat=args.metrics_compat, cors=cors_from_args(args),
                         tokenizer_info=args.enable_tokenizer_info_endpoint, tool_call_parser=args.tool_call_parser,
                         dashboard=args.dashboard, admin_key=args.admin_key or None)
    try:
        replica = build_replica(config, options, registration=registration)
    except EngineRefused as exc:                      # a model or config the engine cannot run
        print(f"kvhive serve: {exc}", file=sys.stderr)
        return 2
    try:
        served = run_server(replica.app, replica.engine, host=args.host, port=args.port, log_level=args.log_level,
                            http_limits=http_limits_from_args(args))
    finally:
        replica.stop_heartbeat()
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
  kvhive serve HuggingFaceTB/SmolLM2-135M-Instruct     a model as vllm serve takes it (--model works too)
  kvhive serve --config serve.yaml --port 8001         flags from YAML (port: 8000, kv_cache_gb: 0.5, ...);
                                                       the command line wins
  kvhive serve --kv-cache-gb 0.5 --max-model-len 4096
  kvhive serve --cpu-offload-gb 4 --disk-cache-dir ~/.cache/kvhive/kv-tier --redis-url redis://127.0.0.1:6379/0
  kvhive serve --api-key "$KEY" --host 0.0.0.0

environment:
  KVHIVE_GRAMMAR_MASK_SYNC=1  compute structured outputs' token masks after the forward pass
                              instead of during it (same tokens; docs/structured_outputs.md)"""


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
    from kvhive.gateway.cli import GATEWAY_DESCRIPTION, GATEWAY_EPILOG, add_gateway_args

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
    commands["serve"].add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model to serve, as --model takes it (the form 'vllm serve MODEL' uses); giving both "
             "with different values is an error (default: --model)")
    for name in ("serve", "gateway"):
        commands[name].add_argument_group("flags from a file").add_argument(
            "--config", default=None, metavar="FILE",
            help=f"a YAML file of '{name}' flags: names without the dashes, with - or _ (port: 8001, "
                 f"kv_cache_gb: 0.5, api_key: [k1, k2], allowed_origins: ['*']); flags on the command "
                 f"line win over the file's (default: none)")
    add_serve_args(commands["serve"])
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
    command = commands[args.command]
    if getattr(args, "config", None) is not None:
        args = with_flag_file(parser, command, argv, args)
    if args.command == "serve":
        resolve_model(command, args)
    return args


def with_flag_file(parser: argparse.ArgumentParser, command: argparse.ArgumentParser, argv: list[str],
                   args: argparse.Namespace) -> argparse.Namespace:
    """``argv`` parsed again with the flags of the ``--config`` YAML file before the command line's
    own (which win: a flag given on the command line is not taken from the file). An unreadable file,
    an unknown key or a value the flag refuses exits 2 naming the file and the key."""
    position = argv.index(args.command) + 1
    given = given_dests(command, argv[position:])
    if getattr(args, "model_tag", None) is not None:
        given |= {"model"}                            # the positional model wins over the file's
    try:
        file_argv = mapping_argv(command, load_flag_file(args.config), skip=given)
    except FlagValueError as exc:
        command.error(f"--config {args.config}: {exc}")
    _, fresh = build_parser()                         # the file's values alone, so errors name the file
    checker = fresh[args.command]
    checker.error = lambda message: command.error(f"--config {args.config}: {message}")  # type: ignore[method-assign]
    checker.parse_known_args(file_argv)
    return parser.parse_args([*argv[:position], *file_argv, *argv[position:]])


def resolve_model(command: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.model`` from the positional MODEL or ``--model``; exits 2 when they name different models."""
    tag = args.model_tag
    if tag is not None and args.model is not None and tag != args.model:
        command.error(f"the positional MODEL {tag!r} and --model {args.model!r} name different models; give one")
    if tag is not None:
        args.model = tag


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
    from kvhive.gateway.cli import run_gateway

    return run_gateway(args)


if __name__ == "__main__":
    sys.exit(main())
