#!/usr/bin/env python3
"""One layer of prefill attention: the C++ kernel at an earlier commit against the working tree's.

    python bench/prefill_kernel_ab.py --rev REV              # REV's kernel against the working tree's
    python bench/prefill_kernel_ab.py --rev REV --cpu-isa avx2   # both built for AVX2 + FMA

Both kernels run on the same pool (the default model's shapes: 30 layers, 3 KV heads, 9 query heads,
head_dim 64, shuffled blocks of 16), alternating, min of --repeat runs per round; the table gives ms,
GFLOP/s and the largest output difference between the two.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS, BLOCK, KV_HEADS, HEADS, HEAD_DIM = 30, 16, 3, 9, 64
SHAPES = ((1600, 100), (0, 1600), (1536, 64))        # (cached tokens, new tokens)


def kernel_at(rev: str | None, isa: str | None = None):
    """CpuPrefillKernel of ``rev`` (None: the working tree): that commit's ``kvhive/model`` (its
    prefill_kernel.py, native.py and C++ sources) is unpacked and loaded beside the installed package."""
    if rev is None:
        from kvhive.model.prefill_kernel import CpuPrefillKernel
        return CpuPrefillKernel.load(isa)
    archive = subprocess.run(["git", "archive", rev, "kvhive/model"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tmp = tempfile.mkdtemp()
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    model_dir = os.path.join(tmp, "kvhive", "model")
    native_name = f"native_{rev}"
    load_module(native_name, os.path.join(model_dir, "native.py"))
    path = os.path.join(model_dir, "prefill_kernel.py")
    with open(path) as f:
        source = f.read().replace("from kvhive.model.native import", f"from {native_name} import")
    with open(path, "w") as f:
        f.write(source)
    return load_module(f"prefill_kernel_{rev}", path).CpuPrefillKernel.load(isa)


def load_module(name: str, path: str):
    """Import the file at ``path`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def min_ms(kernel, call_args: tuple, repeat: int) -> float:
    kernel(*call_args)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        kernel(*call_args)
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="git revision of the kernel to compare against")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-isa", default=None, help="ISA level both kernels are built for (default: the CPU's best)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    kernels = {args.rev: kernel_at(args.rev, args.cpu_isa), "now": kernel_at(None, args.cpu_isa)}
    if None in kernels.values():
        print("no compiler, or no prefill kernel at this ISA level: nothing to compare")
        return 1
    print(f"| dtype | cached + new | {args.rev} (ms) | now (ms) | GFLOP/s {args.rev} -> now | max diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float32):
        for start, n in SHAPES:
            blocks = -(-(start + n) // BLOCK)
            pool = torch.randn(blocks + 3, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
            ids = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(0))[:blocks].contiguous()
            q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)
            call_args = (q, pool, 5, ids, start)         # layer 5 of the pool
            outs = {name: k(*call_args).float() for name, k in kernels.items()}
            best = {name: float("inf") for name in kernels}
            for _ in range(args.rounds):
                for name, k in kernels.items():
                    best[name] = min(best[name], min_ms(k, call_args, args.repeat))
            gflop = 4 * HEADS * HEAD_DIM * n * (start + n / 2) / 1e9
            old, now = best[args.rev], best["now"]
            diff = (outs[args.rev] - outs["now"]).abs().max().item()
            print(f"| {str(dtype).split('.')[-1]} | {start} + {n} | {old:.2f} | {now:.2f} | "
                  f"{gflop / old * 1e3:.0f} -> {gflop / now * 1e3:.0f} | {diff:.2g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
