"""What this CPU and this torch build can run, probed once, and which kernel path each op takes.

The C++ kernels are built per *ISA level*, best first:

| level          | compiler target                     | needs (``/proc/cpuinfo`` flags)              |
| -------------- | ----------------------------------- | -------------------------------------------- |
| ``avx512_bf16``| x86-64-v4 + AVX512-BF16             | avx512f/bw/vl/dq/cd, avx512_bf16             |
| ``avx512``     | x86-64-v4 (AVX-512 F/BW/VL/DQ/CD)   | avx512f/bw/vl/dq/cd                          |
| ``avx2``       | x86-64-v3 (AVX2, FMA, F16C)         | avx2, fma, f16c                              |
| ``portable``   | the architecture's baseline         | nothing (plain C++, compiler-vectorised)     |

``detect()`` reads the flags once; ``CpuFeatures.level(requested)`` picks the best level the CPU
runs, or checks a forced one (``--cpu-isa``), which is how tests run the AVX2 and portable paths on a
host that has more. A forced level also hides what lies above it from torch-side choices (oneDNN's
bf16 weight packing needs AVX-512), so a forced ``avx2`` run takes the paths an AVX2-only host takes.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

LEVELS = ("avx512_bf16", "avx512", "avx2", "portable")      # best first
_NEEDS = {
    "avx512_bf16": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "portable": frozenset(),
}
_X86_TARGETS = {
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mtune=native"),
    "avx512": ("-march=x86-64-v4", "-mtune=native"),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "portable": ("-march=x86-64", "-mtune=native"),
}


def is_x86(machine: str) -> bool:
    """True for x86-64 machine names (``platform.machine()``)."""
    return machine.lower() in ("x86_64", "amd64", "i686", "x86")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's model and ISA flags, and what the torch build can do on it."""

    machine: str                    # platform.machine(): x86_64, aarch64, ...
    model: str                      # "model name" from /proc/cpuinfo (or the platform's processor)
    flags: frozenset[str]           # the "flags" (x86) or "Features" (ARM) line's words
    onednn_bf16: bool               # torch can pack bfloat16 linear weights for oneDNN here

    @property
    def x86(self) -> bool:
        return is_x86(self.machine)

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def neon(self) -> bool:
        return not self.x86 and ("asimd" in self.flags or self.machine.lower() in ("aarch64", "arm64"))

    def supports(self, level: str) -> bool:
        """True when this CPU can run kernels built for ``level``."""
        if level not in LEVELS:
            raise ValueError(f"unknown CPU ISA level {level!r}; expected one of {', '.join(LEVELS)}")
        return level == "portable" or (self.x86 and _NEEDS[level] <= self.flags)

    @property
    def best(self) -> str:
        """The best level this CPU runs."""
        return next(level for level in LEVELS if self.supports(level))

    def level(self, requested: str = "auto") -> str:
        """``requested`` checked against the CPU (``auto``: the best it runs).

        Raises ValueError naming what the CPU lacks when a forced level cannot run here.
        """
        if requested == "auto":
            return self.best
        if not self.supports(requested):
            lacking = sorted(_NEEDS[requested] - self.flags) if self.x86 else [f"an x86 CPU (this is {self.machine})"]
            raise ValueError(f"--cpu-isa {requested}: this CPU lacks {', '.join(lacking)}")
        return requested

    def bf16_packing(self, level: str) -> bool:
        """True when oneDNN bf16 weight packing may be used at ``level`` (it needs AVX-512 or AVX-NE-CONVERT)."""
        return self.onednn_bf16 and (level.startswith("avx512") or not self.x86)

    def describe(self) -> str:
        """One line for logs: model and the flags that matter here."""
        shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                             "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert", "asimd", "sve")
                 if f in self.flags]
        return f"{self.model or self.machine} ({self.machine}; {' '.join(shown) or 'no SIMD flags read'})"


def resolve(isa: str | None) -> str:
    """A kernel's ISA level: ``isa`` checked against this CPU, or its best level for None / ``auto``."""
    return detect().level(isa or "auto")


def check_dtype(dtype: str, device: str) -> None:
    """ValueError where ``dtype`` cannot run on ``device`` at all (float16 on a CPU)."""
    if device == "cpu" and dtype == "float16":
        raise ValueError("--dtype float16 needs a GPU: kvhive's CPU kernels and oneDNN compute in float32 or "
                         "bfloat16, and this CPU's float16 arithmetic (AVX512-FP16, AMX-FP16) is not used; "
                         "use --dtype bfloat16 for half-size weights and KV")


def compile_flags(level: str, machine: str | None = None) -> tuple[str, ...]:
    """Compiler target flags for kernels of ``level`` on this machine's architecture."""
    if level not in LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r}")
    machine = machine or platform.machine()
    if is_x86(machine):
        return _X86_TARGETS[level]
    return ("-mcpu=native",) if level == "portable" else ()


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor(), flags


def _onednn_bf16() -> bool:
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def detect() -> CpuFeatures:
    """Probe the CPU (``/proc/cpuinfo``) and the torch build (once per process: hardware facts)."""
    model, flags = _read_cpuinfo()
    return CpuFeatures(machine=platform.machine(), model=model, flags=flags, onednn_bf16=_onednn_bf16())
