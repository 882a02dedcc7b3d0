"""Build the CPU kernels ahead of the first start (``kvhive warmup``).

Each kernel is built for the ISA level the server would pick (or a forced one) into the kernel
cache (``kvhive.model.native.default_cache_dir``); a later ``kvhive serve`` loads them without
compiling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvhive.model import cpu


@dataclass(frozen=True)
class KernelBuild:
    """One kernel library: its name, ISA level, whether it loaded, and the seconds it took."""

    name: str
    isa: str
    ok: bool
    seconds: float


def build_kernels(isa: str | None = None) -> list[KernelBuild]:
    """Build (or find cached) every CPU kernel for ``isa`` (None: the CPU's best level)."""
    from kvhive.model.decode_kernel import CpuDecodeKernel
    from kvhive.model.fused import FusedOps
    from kvhive.model.prefill_kernel import CpuPrefillKernel
    from kvhive.model.quant import QuantMatmul

    level = cpu.resolve(isa)
    builds = []
    for name, kernel in (("decode attention", CpuDecodeKernel), ("prefill attention", CpuPrefillKernel),
                         ("quantised matmul", QuantMatmul), ("elementwise", FusedOps)):
        started = time.perf_counter()
        loaded = kernel.load(level)
        builds.append(KernelBuild(name, level, loaded is not None, time.perf_counter() - started))
    return builds
