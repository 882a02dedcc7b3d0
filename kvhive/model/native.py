"""Small C++ kernels compiled once per machine with the system compiler and loaded through ctypes.

A library is keyed by its source, the compiler, the flags and the CPU model (``-march=native``), so
a cached build never runs on a CPU it was not built for. Builds are atomic (compile to a temporary
file, then rename), so concurrent processes that build the same library agree on one file.
``-fopenmp`` libraries share PyTorch's OpenMP runtime: torch loads ``libgomp.so.1`` first and the
dynamic linker reuses it, so kernels and torch ops use one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)

DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

# C++ for any kernel (after ``<cstdint>`` and ``<cstring>``): bfloat16 <-> float32 one value at a
# time, rounding to nearest even and keeping NaN a NaN, as torch does.
BF16_SCALAR = r"""
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {   // round to nearest even, NaN -> 0x7FC0 (as torch does)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t rounded = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  return (bits & 0x7FFFFFFF) > 0x7F800000 ? uint16_t(0x7FC0) : rounded;
}
"""

# C++ for AVX-512 kernels (after ``#include <immintrin.h>``): 2^x in float32 lanes, ~1e-7 relative,
# a degree-6 polynomial on the fraction scaled by the integer part. Inputs are clamped to
# [-125, 127], so very negative x gives ~2^-125 (never a denormal) and callers mask exact zeros.
AVX512_EXP2 = r"""
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-125.f)), _mm512_set1_ps(127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.540353e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.333355e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
"""

# C++ for AVX-512 kernels (after ``#include <immintrin.h>``): the horizontal sums of n <= 16 vectors
# as one vector (lane i = sum of v[i], 0 past n), by a transpose-add tree: 45 instructions for 16
# sums instead of ~8 for each. Used by the quantised matmul and the decode attention kernels.
AVX512_SUM16 = r"""
inline __m512 sum16(const __m512* v, int n) {
  __m512 x[16], s[8], t[4];
  for (int i = 0; i < 16; ++i) {       // fed transposed (the tree returns v0 v4 v8 v12 v1 ...)
    const int src = (i % 4) * 4 + i / 4;
    x[i] = src < n ? v[src] : _mm512_setzero_ps();
  }
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
}
"""


def cpu_model() -> str:
    """The CPU's model name and flags line (part of every library's cache key)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        return platform.processor()


def build_library(name: str, source: str, flags: tuple[str, ...] = DEFAULT_FLAGS,
                  cache_dir: str | None = None) -> ctypes.CDLL | None:
    """Compile ``source`` (cached) and load it; None, with a warning, without a working compiler."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found: the %s kernel is unavailable", name)
        return None
    key = hashlib.sha256("\n".join([source, compiler, *flags, platform.machine(),
                                    cpu_model()]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir or tempfile.gettempdir(), f"kvhive-{name}-{key}.so")
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                src, lib = os.path.join(tmp, f"{name}.cpp"), os.path.join(tmp, f"{name}.so")
                with open(src, "w") as f:
                    f.write(source)
                subprocess.run([compiler, *flags, "-o", lib, src], check=True, capture_output=True)
                shutil.copyfile(lib, path + f".{os.getpid()}")
                os.replace(path + f".{os.getpid()}", path)
        return ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else e
        logger.warning("the %s kernel is unavailable: %s", name, detail)
        return None
