#!/usr/bin/env python3
"""One layer of prefill attention over float32, bf16, int8 and fp8 KV pools (C++ kernel, CPU).

    python bench/prefill_kv8.py                  # the working tree's kernel
    python bench/prefill_kv8.py --rev REV        # float32/bf16 pools also on REV's kernel (before/after)

SmolLM2-135M shapes (30 layers, 9 query heads on 3 KV heads of 64, shuffled blocks of 16): a
1,024-token first chunk and 96 new tokens on 1,024 cached. All variants of one shape take turns,
min of --repeat runs; ms per layer. On a busy shared host, ``--threads 1 --cpu-time`` (the process's
CPU time per call, not wall time) gives steadier numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefill_kernel_ab import kernel_at  # noqa: E402

from kvhive.model.kv_quant import quantize_rows  # noqa: E402
from kvhive.model.timing import min_times  # noqa: E402

LAYERS, BLOCK, KV_HEADS, HEADS, HEAD_DIM = 30, 16, 3, 9, 64
SHAPES = ((0, 1024), (1024, 96))        # (cached tokens, new tokens)


def variants(kernels: dict, start: int, n: int) -> dict:
    """name -> a call of one layer: float pools on every kernel (bf16 on both of its paths), 8-bit
    pools (float32 and bf16 queries) on the working tree's."""
    blocks = -(-(start + n) // BLOCK)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(blocks + 3, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    ids = torch.randperm(blocks + 3, generator=g)[:blocks].contiguous()
    q32 = torch.randn(n, HEADS, HEAD_DIM, generator=g)
    calls = {}
    for rev, kernel in kernels.items():
        calls[f"float32 pool ({rev})"] = (kernel, q32, values, None)
        for path in ("native", "wide"):
            calls[f"bf16 pool, {path} ({rev})"] = (kernel, q32.bfloat16(), values.bfloat16(), path)
    now = kernels["now"]
    for kv in ("int8", "fp8"):
        pool = quantize_rows(values, kv)
        for q in (q32, q32.bfloat16()):
            calls[f"{kv} pool, {str(q.dtype).split('.')[-1]} q"] = (now, q, pool, None)
    return {name: make_call(*spec, ids, start) for name, spec in calls.items()}


def make_call(kernel, q: torch.Tensor, pool: torch.Tensor, path: str | None, ids: torch.Tensor, start: int):
    """A no-argument call of layer 5; a bf16 pool's path (if given) is fixed just before each call."""
    def call():
        if path is not None:
            kernel.pick_bf16_path(path)
        return kernel(q, pool, 5, ids, start)
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=None, help="git revision whose kernel also runs the float pools")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="time CPU time per call, not wall time")
    ap.add_argument("--cpu-isa", default=None, help="ISA level the kernels are built for (default: the CPU's best)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {"now": kernel_at(None, args.cpu_isa)}
    if args.rev:
        kernels[args.rev] = kernel_at(args.rev, args.cpu_isa)
    if None in kernels.values():
        print("no compiler, or no prefill kernel at this ISA level")
        return 1
    print(f"| pool | {' | '.join(f'{s} + {n} (ms)' for s, n in SHAPES)} |")
    print("| --- |" + " --- |" * len(SHAPES))
    rows: dict[str, list[float]] = {}
    for start, n in SHAPES:
        calls = variants(kernels, start, n)
        clock = time.process_time if args.cpu_time else time.perf_counter
        for name, t in zip(calls, min_times(list(calls.values()), args.repeat, clock), strict=True):
            rows.setdefault(name, []).append(t * 1e3)
    for name, times in rows.items():
        print(f"| {name} | {' | '.join(f'{t:.2f}' for t in times)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
