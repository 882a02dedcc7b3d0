#!/usr/bin/env python3
"""Decode and prefill step times of a Llama-3.1-8B-shaped model with random weights, paged attention
kernels against the gather path, each beside its floor.

    python bench/gpu_decode.py --out gpu_out                      # on a GPU (bench/gpu_check.sh runs it)
    python bench/gpu_decode.py --device cpu --smoke --out /tmp/x  # a tiny model on CPU, in seconds

The model is built by ``load_model(..., load_format="dummy")`` from a config.json this script writes
(Llama 3.1 8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256,
llama3 RoPE scaling, bfloat16), and every step goes through ``ModelRunner.execute`` with a
``StepPlan``, the path ``kvhive serve`` runs: decode-only steps replay the runner's CUDA graphs
(captured for buckets up to the case's batch and context; batches above the largest row bucket run
eagerly, as they do when served). Per ``--attention-backend`` (triton: paged kernels reading the
block table in place; torch: K/V gathered for SDPA), each (batch, context) decode step and an
N-token prefill are timed with CUDA events (median of ``--repeat`` after warm-up).

Floors: decode = (weight bytes + KV bytes the step reads) / HBM bandwidth, measured as a large
device-to-device copy (2 x bytes / time); prefill = FLOPs / bf16 matmul peak, measured on a large
square matmul. A (batch, context) whose KV pool does not fit in free device memory is skipped, and
the JSON says so. Writes ``gpu_decode.json`` and ``gpu_decode.md`` under ``--out``, with the
targets (decode at batch 32 / 8k within 1.5x of its floor; paged >= 2x the gather path at 8k)
evaluated as met, missed or not measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_info import command, machine  # noqa: E402

from kvhive.engine.runner import ModelRunner  # noqa: E402
from kvhive.engine.step import ScheduledSeq, StepPlan  # noqa: E402
from kvhive.model.loader import LoadedModel, load_model  # noqa: E402
from kvhive.request import SamplingParams  # noqa: E402

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)
GIB = 1 << 30
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}
# The same graph at toy sizes, for --smoke (CPU, seconds).
SMOKE = {**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
         "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
         "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "original_max_position_embeddings": 64}}
TARGET_DECODE = (32, 8192, 1.5)        # batch, context, most step / floor
TARGET_PAGED_CONTEXT, TARGET_PAGED_SPEEDUP = 8192, 2.0


def write_config(out_dir: str, smoke: bool) -> str:
    """The model's config.json under ``out_dir``; its path."""
    path = os.path.join(out_dir, "llama31_8b_shape" if not smoke else "smoke_shape")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SMOKE if smoke else LLAMA_31_8B, f, indent=1)
    return os.path.join(path, "config.json")


def median_ms(fn: Callable[[], object], repeat: int, device: torch.device, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def hbm_bandwidth(device: torch.device, nbytes: int, repeat: int) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (it reads and writes them: 2 x nbytes)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeat, device)
    return 2 * nbytes / (ms / 1000)


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, repeat: int) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = median_ms(lambda: a @ b, repeat, device)
    return 2 * n ** 3 / (ms / 1000)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter once, the embedding table aside
    (a lookup reads only the batch's rows) unless it is the LM head too."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if model.lm_head is not model.embed_tokens:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def kv_bytes(loaded: LoadedModel, batch: int, context: int) -> int:
    """Bytes of K and V a decode step of ``batch`` sequences at ``context`` tokens reads (all layers)."""
    c = loaded.config
    return batch * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * loaded.model.dtype.itemsize


def prefill_flops(loaded: LoadedModel, n: int) -> int:
    """FLOPs of an n-token prefill from nothing: the layers' projections on every token, the LM head
    on the one sampled row, and causal attention (QK^T and PV over n(n+1)/2 pairs per head)."""
    c = loaded.config
    hd = c.head_dim
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * hd + c.num_heads * hd * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    attention = 4 * c.num_layers * c.num_heads * hd * n * (n + 1) // 2
    return 2 * n * c.num_layers * per_layer + 2 * c.hidden_size * c.vocab_size + attention


def decode_plan(batch: int, context: int) -> StepPlan:
    """A decode step of ``batch`` sequences, each attending to ``context`` keys (its new token last),
    in blocks 1.. (block 0 is the CUDA graphs' padding block)."""
    per_seq = -(-context // BLOCK)
    return StepPlan([ScheduledSeq(f"d{i}", [11 + i % 100], context - 1,
                                  list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True, GREEDY)
                     for i in range(batch)])


def prefill_plan(n: int) -> StepPlan:
    """One ``n``-token prompt from nothing, its last row sampled."""
    return StepPlan([ScheduledSeq("p", [11 + i % 200 for i in range(n)], 0, list(range(1, 1 + -(-n // BLOCK))),
                                  True, GREEDY)])


def make_runner(loaded: LoadedModel, backend: str, batch: int, context: int, graphs: bool) -> ModelRunner:
    """A runner whose pool holds ``batch`` sequences of ``context`` tokens, with the CUDA graphs a
    server with ``--max-num-seqs batch`` and ``--max-model-len context`` captures."""
    model = loaded.model
    config = dataclasses.replace(loaded.config, max_position_embeddings=context)
    return ModelRunner(model, config, num_blocks=1 + batch * -(-context // BLOCK), block_size=BLOCK,
                       dtype=model.dtype, device=model.device, cuda_graphs=graphs, max_num_seqs=batch,
                       attention_backend=backend)


def does_not_fit(loaded: LoadedModel, batch: int, context: int) -> str | None:
    """Why a case's pool and gather workspace would not fit in free device memory (None: it fits)."""
    if loaded.model.device.type != "cuda":
        return None
    pool = kv_bytes(loaded, batch, context)
    workspace = 3 * pool // loaded.config.num_layers + GIB       # one layer's gathered K/V and SDPA's copy
    free = torch.cuda.mem_get_info(loaded.model.device)[0]
    if pool + workspace > free:
        return f"needs {(pool + workspace) / GIB:.1f} GiB (KV pool {pool / GIB:.1f}), {free / GIB:.1f} GiB free"
    return None


def _failure(exc: BaseException) -> str:
    """What a case that raised records (out of memory named as such)."""
    first = (str(exc).splitlines() or [""])[0][:300]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return f"out of device memory ({first})"
    return f"failed: {type(exc).__name__}: {first}"


def release() -> None:
    """Free what the last case held on the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepTiming(NamedTuple):
    """A step's median time, whether it replayed a CUDA graph, and the attention paths it took."""

    ms: float
    cuda_graph: bool
    attention: dict[str, str]


def time_step(loaded: LoadedModel, backend: str, batch: int, context: int, plan: StepPlan, graphs: bool,
              repeat: int) -> StepTiming | str:
    """``plan``'s median time on a runner sized for ``batch`` x ``context``, or why it was not timed."""
    reason = does_not_fit(loaded, batch, context)
    if reason is not None:
        return reason
    runner = None
    try:
        runner = make_runner(loaded, backend, batch, context, graphs)
        ms = median_ms(lambda: runner.execute(plan), repeat, loaded.model.device)
        graphed = runner.decode_graphs is not None and runner.decode_graphs.num_steps > 0
        return StepTiming(ms, graphed, runner.paths())
    except Exception as exc:  # noqa: BLE001 - one failed case is recorded; the others run
        return _failure(exc)
    finally:
        runner = None
        release()


def decode_case(loaded: LoadedModel, backend: str, batch: int, context: int, args: argparse.Namespace,
                floors: dict[str, float]) -> dict:
    """One decode case's median step time beside its floor (or why it was skipped)."""
    case = {"kind": "decode", "backend": backend, "batch": batch, "context": context}
    graphs = loaded.model.device.type == "cuda" and not args.enforce_eager
    timing = time_step(loaded, backend, batch, context, decode_plan(batch, context), graphs, args.repeat)
    if isinstance(timing, str):
        return {**case, "skipped": timing}
    moved = floors["weight_bytes"] + kv_bytes(loaded, batch, context)
    floor_ms = 1000 * moved / floors["hbm_bytes_per_s"]
    return {**case, "step_ms": timing.ms, "floor_ms": floor_ms, "x_floor": timing.ms / floor_ms,
            "bytes_read": moved, "cuda_graph": timing.cuda_graph, "attention": timing.attention}


def prefill_case(loaded: LoadedModel, backend: str, n: int, args: argparse.Namespace, floors: dict[str, float]) -> dict:
    """The ``n``-token prefill's median time beside its FLOPs floor (or why it was skipped)."""
    case = {"kind": "prefill", "backend": backend, "batch": 1, "context": n}
    timing = time_step(loaded, backend, 1, n, prefill_plan(n), False, args.repeat)
    if isinstance(timing, str):
        return {**case, "skipped": timing}
    flops = prefill_flops(loaded, n)
    floor_ms = 1000 * flops / floors["matmul_flop_per_s"]
    return {**case, "step_ms": timing.ms, "floor_ms": floor_ms, "x_floor": timing.ms / floor_ms, "flops": flops,
            "attention": timing.attention}


def backend_problem(loaded: LoadedModel, backend: str) -> str | None:
    """Why ``backend`` cannot run here (the runner's ValueError), or None when it can."""
    try:
        make_runner(loaded, backend, 1, BLOCK, graphs=False)
    except ValueError as exc:
        return f"unavailable: {exc}"
    finally:
        release()
    return None


def case_order(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(kind, batch, context) of every case, the targets' first (a run cut short keeps them): decode
    at the target batch and context, the prefill, then every other decode case."""
    batch, context, _ = TARGET_DECODE
    decodes = [("decode", b, c) for c in args.contexts for b in args.batches]
    first = [("decode", batch, context)] if ("decode", batch, context) in decodes else []
    return first + [("prefill", 1, args.prefill)] + [d for d in decodes if d not in first]


def run_cases(loaded: LoadedModel, args: argparse.Namespace, floors: dict[str, float],
              record: Callable[[list[dict]], None]) -> list[dict]:
    """Every case on every available backend, in ``case_order``, each backend beside the other;
    ``record`` gets the cases so far after each one."""
    cases: list[dict] = []
    backends = []
    for backend in args.backends:
        problem = backend_problem(loaded, backend)
        if problem is None:
            backends.append(backend)
        else:
            cases.append({"kind": "backend", "backend": backend, "skipped": problem})
    for kind, batch, context in case_order(args):
        for backend in backends:
            if kind == "decode":
                case = decode_case(loaded, backend, batch, context, args, floors)
            else:
                case = prefill_case(loaded, backend, context, args, floors)
            cases.append(case)
            print(json.dumps(case), flush=True)
            record(cases)
    record(cases)
    return cases


def _measured(cases: list[dict], backend: str, kind: str, batch: int, context: int) -> dict | None:
    return next((c for c in cases if c.get("backend") == backend and c.get("kind") == kind
                 and c.get("batch") == batch and c.get("context") == context and "step_ms" in c), None)


def evaluate_targets(cases: list[dict]) -> dict[str, dict]:
    """The targets: decode at batch 32 / 8k within 1.5x of its floor (paged kernels), and paged >=
    2x faster than the gather path at 8k (each batch measured with both)."""
    batch, context, most = TARGET_DECODE
    paged = _measured(cases, "triton", "decode", batch, context)
    decode = {"target": f"paged decode at batch {batch} / context {context} <= {most}x its floor"}
    decode.update({"status": "not measured"} if paged is None else
                  {"status": "met" if paged["x_floor"] <= most else "missed", "x_floor": paged["x_floor"]})
    speedups = {}
    for case in cases:
        if case.get("backend") == "triton" and case.get("kind") == "decode" and "step_ms" in case \
                and case["context"] == TARGET_PAGED_CONTEXT:
            gather = _measured(cases, "torch", "decode", case["batch"], case["context"])
            if gather is not None:
                speedups[f"batch {case['batch']}"] = gather["step_ms"] / case["step_ms"]
    speedup = {"target": f"paged >= {TARGET_PAGED_SPEEDUP}x faster than gather at context {TARGET_PAGED_CONTEXT}",
               "speedups": speedups}
    big = speedups.get(f"batch {batch}")
    speedup["status"] = ("not measured" if big is None else "met" if big >= TARGET_PAGED_SPEEDUP else "missed")
    speedup["judged_at"] = f"batch {batch} (KV bytes dominate; at batch 1 the weights do)"
    return {"decode_floor": decode, "paged_vs_gather": speedup}


def markdown(record: dict) -> str:
    """The cases as a table, with the floors' inputs and the targets."""
    f = record["floors"]
    lines = [f"# Decode and prefill on {record['device_name']} ({record['dtype']})", "",
             f"HBM copy bandwidth {f['hbm_bytes_per_s'] / 1e9:.4g} GB/s; {record['dtype']} matmul peak "
             f"{f['matmul_flop_per_s'] / 1e12:.4g} TFLOP/s; weights read per step {f['weight_bytes'] / 1e9:.4g} GB.", "",
             "| step | backend | batch | context | ms | floor ms | x floor | CUDA graph |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in record["cases"]:
        if "step_ms" in c:
            lines.append(f"| {c['kind']} | {c['backend']} | {c['batch']} | {c['context']} | {c['step_ms']:.2f} | "
                         f"{c['floor_ms']:.2f} | {c['x_floor']:.2f} | {c.get('cuda_graph', '-')} |")
        else:
            lines.append(f"| {c['kind']} | {c['backend']} | {c.get('batch', '-')} | {c.get('context', '-')} | "
                         f"skipped: {c['skipped']} | | | |")
    lines += ["", "| target | status | detail |", "|---|---|---|"]
    for t in record["targets"].values():
        detail = {k: v for k, v in t.items() if k not in ("target", "status")}
        lines.append(f"| {t['target']} | {t['status']} | {json.dumps(detail)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--smoke`` replaces the shapes by toy ones."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--backends", default="triton,torch", help="--attention-backend values to time")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--prefill", type=int, default=8192, help="prompt tokens of the timed prefill")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per case (the median is kept)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    ap.add_argument("--smoke", action="store_true", help="toy model and shapes, torch backend (CPU tests)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"), help="directory of the results")
    args = ap.parse_args(argv)
    if args.smoke:
        args.backends, args.batches, args.contexts, args.prefill, args.repeat = "torch", "1,2", "64,128", 128, 3
        args.dtype = "float32" if args.device == "cpu" else args.dtype
    args.backends = args.backends.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    return args


def measure_floors(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, float]:
    """The device's copy bandwidth and matmul peak, and the bytes of weights a step reads."""
    device, small = loaded.model.device, args.smoke
    return {"hbm_bytes_per_s": hbm_bandwidth(device, (32 << 20) if small else (4 << 30), args.repeat),
            "matmul_flop_per_s": matmul_peak(device, loaded.model.dtype, 256 if small else 8192, args.repeat),
            "weight_bytes": weight_bytes(loaded.model)}


def write_results(out: str, record: dict) -> None:
    """gpu_decode.json and gpu_decode.md under ``out`` (rewritten after every case)."""
    with open(os.path.join(out, "gpu_decode.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(out, "gpu_decode.md"), "w") as f:
        f.write(markdown(record))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    started = time.perf_counter()
    loaded = load_model(write_config(args.out, args.smoke), dtype=args.dtype, device=args.device,
                        pack_weights=False, load_format="dummy")
    print(f"built the dummy model ({loaded.fingerprint}) in {time.perf_counter() - started:.1f} s", flush=True)
    floors = measure_floors(loaded, args)
    base = {"machine": machine(), "command": command(__file__), "date": time.strftime("%Y-%m-%d %H:%M"),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "dtype": args.dtype, "model": "smoke" if args.smoke else "Llama-3.1-8B shape, dummy weights",
            "fingerprint": loaded.fingerprint, "floors": floors}

    def record(cases: list[dict]) -> dict:
        whole = {**base, "cases": cases, "targets": evaluate_targets(cases), "seconds": time.perf_counter() - started}
        write_results(args.out, whole)
        return whole

    print(markdown(record(run_cases(loaded, args, floors, record))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
