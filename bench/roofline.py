#!/usr/bin/env python3
"""How far kvhive's decode step and warm turn are from this host's physical floor.

Measures, with --threads threads:
- memory bandwidth: a read-only sum over a 512 MiB float32 tensor (what a weight-streaming GEMV
  does), and a copy;
- GEMM peak: float32 (and bfloat16) ``a @ b`` at prefill shapes of the default model;
- kvhive: a batch-1 decode step at --context tokens and a warm turn (--new tokens on --context
  cached), through ModelRunner at the chosen --cpu-isa.

Floors: decode = (weight bytes a decode step reads: the GGUF blocks of every projection and the LM
head, or the dense copy without them + the KV bytes of the context) / read bandwidth; warm turn =
(2 x layer parameters x new tokens + the LM head on one row + attention FLOPs) / GEMM peak, and its
weight and KV bytes / bandwidth, whichever is larger. Writes ``bench/results/roofline.json``.

    python bench/roofline.py
    python bench/roofline.py --cpu-isa avx2 --tag avx2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from forward_speed import decode_plan, warm_prefill_plan  # noqa: E402
from run_info import command  # noqa: E402

from kvhive.core.model_files import default_model_path  # noqa: E402
from kvhive.engine.runner import ModelRunner  # noqa: E402
from kvhive.model import cpu  # noqa: E402
from kvhive.model.loader import load_model  # noqa: E402


def median_time(fn, repeat: int) -> float:
    """Median seconds of fn() over repeat runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(repeat: int) -> dict[str, float]:
    """Read and copy bandwidth in GB/s over 512 MiB (far beyond any cache)."""
    x = torch.ones(128 * 2**20, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4
    read = nbytes / median_time(lambda: x.sum(), repeat) / 1e9
    copy = 2 * nbytes / median_time(lambda: y.copy_(x), repeat) / 1e9
    return {"read_gb_s": read, "copy_gb_s": copy}


def gemm_peak(repeat: int) -> dict[str, float]:
    """GFLOP/s of a @ b at the default model's prefill MLP shape, float32 and bfloat16."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(1024, 576, dtype=dtype)
        b = torch.randn(576, 1536, dtype=dtype)
        out[str(dtype).removeprefix("torch.")] = 2 * 1024 * 576 * 1536 / median_time(lambda a=a, b=b: a @ b, repeat) / 1e9
    return out


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes a decode step reads for weights, parameters of the layers, of the LM head)."""
    layer_params = sum(p.numel() for layer in model.layers for p in layer.parameters())
    head_params = model.lm_head.numel()
    params = layer_params + head_params
    if model.qmatmul is not None:
        quant = [*(w for layer in model.quant_layers for w in layer.values()), model.quant_lm_head]
        nbytes = sum(w.qs.numel() * w.qs.element_size() + w.d.numel() * 4 + w.m.numel() * 4 for w in quant)
    else:
        nbytes = params * model.embed_tokens.element_size()
    return nbytes, layer_params, head_params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=1600)
    ap.add_argument("--new", type=int, default=100, help="new tokens of the warm turn")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    features = cpu.detect()
    isa = features.level(args.cpu_isa)
    loaded = load_model(default_model_path(), dtype=args.dtype, isa=isa)
    model, c = loaded.model, loaded.config
    blocks = 4 * (args.context + args.new) // 16 + 16
    runner = ModelRunner(model, c, num_blocks=blocks, block_size=16, dtype=args.dtype, isa=isa)
    with torch.inference_mode():
        decode_s = median_time(lambda: runner.execute(decode_plan(1, args.context)), args.repeat)
        warm_s = median_time(lambda: runner.execute(warm_prefill_plan(args.context, args.new)), args.repeat)
    bw, peak = bandwidth(args.repeat), gemm_peak(args.repeat)
    wbytes, layer_params, head_params = weight_bytes(model)
    kv_bytes = args.context * c.kv_values_per_token * runner.kv_cache.element_size()
    decode_floor = (wbytes + kv_bytes) / (bw["read_gb_s"] * 1e9)
    attn_flops = 4 * c.num_layers * c.num_heads * c.head_dim * args.new * (args.context + args.new / 2)
    # The warm turn's projections run on the dense copy (more rows than the quantised path takes);
    # the LM head runs on its last row only.
    dense_bytes = (layer_params + head_params) * runner.kv_cache.element_size()
    flops = 2 * layer_params * args.new + 2 * head_params + attn_flops
    warm_floor = max(flops / (peak[args.dtype] * 1e9),
                     (dense_bytes + kv_bytes) / (bw["read_gb_s"] * 1e9))
    flags = " ".join(sorted(f for f in features.flags if f.startswith(("avx", "amx", "fma", "f16c"))))
    record = {
        "machine": f"{features.model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "flags": flags, "cpu_isa": isa, "dtype": args.dtype, "threads": args.threads,
        "command": command(__file__), "date": time.strftime("%Y-%m-%d"),
        "paths": {**model.paths(), **runner.paths()},
        "bandwidth": bw, "gemm_gflops": peak,
        "decode": {"context": args.context, "weight_bytes": wbytes, "kv_bytes": kv_bytes,
                   "floor_ms": decode_floor * 1e3, "measured_ms": decode_s * 1e3,
                   "ratio": decode_s / decode_floor},
        "warm_turn": {"context": args.context, "new_tokens": args.new, "flops": flops,
                      "floor_ms": warm_floor * 1e3, "measured_ms": warm_s * 1e3, "ratio": warm_s / warm_floor},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"roofline{'_' + args.tag if args.tag else ''}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
