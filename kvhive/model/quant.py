"""Matmul straight from GGUF's quantised weights (Q4_1, Q8_0) for steps with few rows.

Decode reads every weight once per step, so its speed is the bytes it reads: the dequantised
float32 copy of SmolLM2's layers and LM head is ~540 MB, the file's own Q4_1/Q8_0 blocks ~90 MB.
``QuantWeight`` keeps a GGUF tensor's blocks (nibbles or int8 plus float32 scales converted exactly
from the file's float16); ``QuantMatmul`` multiplies float32 rows by them in a small C++ kernel.
Each weight is rebuilt as ``d * q + m`` in float32 with two roundings, exactly what
``gguf.quants.dequantize`` computes, so results differ from the dense path only in summation order.
Prefill (many rows) stays on the dense oneDNN copy, where the CPU is compute-bound instead.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvhive.model.native import build_library

logger = logging.getLogger(__name__)

QK = 32                                   # weights per GGUF block (Q4_1 and Q8_0)
KINDS = {"Q4_1": 0, "Q8_0": 1}
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}   # float16 d [, float16 m], then the packed values


@dataclass(frozen=True)
class QuantWeight:
    """A [out_features, in_features] weight as GGUF blocks along in_features.

    ``qs`` is uint8 [out, in / 32, 16] for Q4_1 (byte j holds value j in its low nibble and value
    j + 16 in its high nibble, as in the file) or int8-as-uint8 [out, in / 32, 32] for Q8_0; ``d``
    and ``m`` are float32 [out, in / 32] (``m`` is zero for Q8_0).
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return self.qs.shape[0], self.qs.shape[1] * QK

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, out_features: int, in_features: int) -> QuantWeight:
        """From a GGUF tensor's raw bytes (row-major, ``in_features / 32`` blocks per row)."""
        if kind not in KINDS:
            raise ValueError(f"unsupported quantisation {kind!r}")
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(out_features, in_features // QK,
                                                                   _BLOCK_BYTES[kind])
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = blocks[..., 4:]
        else:
            m = np.zeros_like(d)
            qs = blocks[..., 2:]
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(d), torch.from_numpy(m))

    def take_rows(self, index: np.ndarray) -> QuantWeight:
        """The weight with its output rows reordered (quantisation blocks run along the input axis)."""
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        return QuantWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                           self.m[idx].contiguous())

    @staticmethod
    def concat(parts: list[QuantWeight]) -> QuantWeight:
        """Parts stacked along the output axis (fused QKV, fused gate+up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different quantisations {sorted(kinds)}")
        return QuantWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]),
                           torch.cat([p.m for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], bit-equal to ``gguf.quants.dequantize`` of the same blocks."""
        if self.kind == "Q4_1":
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()
        else:
            q = self.qs.view(torch.int8).float()
        return (self.d[..., None] * q + self.m[..., None]).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))


class _Args(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("qs", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("kind", ctypes.c_int),
                ("residual", ctypes.c_void_p), ("res_stride", ctypes.c_int64),
                ("out", ctypes.c_void_p), ("n_threads", ctypes.c_int)]


class QuantMatmul:
    """``residual + x @ W.T`` for float32 x [rows, in] and a ``QuantWeight`` W, on CPU."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvhive_qmatmul
        self._fn.argtypes = [ctypes.POINTER(_Args)]
        self._fn.restype = ctypes.c_int

    @classmethod
    def load(cls, portable: bool = False, cache_dir: str | None = None) -> QuantMatmul | None:
        """The kernel (AVX-512 where the CPU has it, else portable C++); None without a compiler.

        ``portable`` forces the portable path (tests use it to check both).
        """
        # No -ffast-math, no contraction: d * q + m must round twice, as gguf's numpy code does.
        flags = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
        if portable:
            flags = ("-DKVHIVE_PORTABLE", *flags)
        lib = build_library("qmatmul", _KERNEL_SOURCE, flags, cache_dir)
        return None if lib is None else cls(lib)

    def __call__(self, x: torch.Tensor, w: QuantWeight, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (float32 or bfloat16, rows may be strided) -> [rows, out] in x's dtype."""
        n, k = w.shape
        dtype = x.dtype
        if x.dtype != torch.float32:
            x = x.float()
        if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"x must be [rows, {k}] with contiguous rows, got {tuple(x.shape)}")
        res = None
        if residual is not None:
            res = residual if residual.dtype == torch.float32 else residual.float()
            if res.shape != (x.shape[0], n) or res.stride(1) != 1:
                raise ValueError(f"residual must be [{x.shape[0]}, {n}] with contiguous rows")
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        args = _Args(x.data_ptr(), x.stride(0), x.shape[0], w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(),
                     n, k, KINDS[w.kind], 0 if res is None else res.data_ptr(),
                     0 if res is None else res.stride(0), out.data_ptr(), torch.get_num_threads())
        if self._fn(ctypes.byref(args)):
            raise ValueError(f"qmatmul: unsupported shape {w.kind} {n}x{k}")
        return out if dtype == torch.float32 else out.to(dtype)


_KERNEL_SOURCE = r"""
// residual + x @ W^T with W in GGUF blocks of 32 along k: Q4_1 (w = d*q + m, q in 0..15) or
// Q8_0 (w = d*q, q int8). Each weight is rebuilt in float32 exactly as gguf's dequantiser does
// (product, then sum: built without FP contraction), then multiplied into up to 8 rows at once.
// Threads split the output features; every row tile re-reads a weight row from L1, not memory.
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && !defined(KVHIVE_PORTABLE)
#include <immintrin.h>
#define KVHIVE_AVX512 1
#endif

namespace {
struct Args {
  const float* x; int64_t x_stride, rows; const uint8_t* qs; const float* d; const float* m;
  int64_t n, k; int kind; const float* residual; int64_t res_stride; float* out; int n_threads;
};

constexpr int kTile = 8;

#ifdef KVHIVE_AVX512
// The 32 weights of one block as two vectors (values 0-15 and 16-31).
template <int KIND>
inline void block_weights(const uint8_t* q, float d, float m, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(d);
  if (KIND == 0) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m512 vm = _mm512_set1_ps(m);
    w0 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))), vd), vm);
    w1 = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low))), vd), vm);
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vd);
  }
}

template <int KIND, int R>
void row_tile(const Args& a, int64_t r0, int64_t j) {
  const int64_t nb = a.k / 32, qb = KIND == 0 ? 16 : 32;
  const uint8_t* q = a.qs + j * nb * qb;
  const float* d = a.d + j * nb;
  const float* m = a.m + j * nb;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0, w1;
    block_weights<KIND>(q + b * qb, d[b], m[b], w0, w1);
    for (int r = 0; r < R; ++r) {
      const float* x = a.x + (r0 + r) * a.x_stride + b * 32;
      acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc[r]);
      acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = _mm512_reduce_add_ps(acc[r]);
    if (a.residual) s += a.residual[(r0 + r) * a.res_stride + j];
    a.out[(r0 + r) * a.n + j] = s;
  }
}
#else
template <int KIND>
inline void block_weights(const uint8_t* q, float d, float m, float* w) {
  if (KIND == 0) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) {
      const float lo = float(q[i] & 0x0F) * d, hi = float(q[i] >> 4) * d;
      w[i] = lo + m;
      w[i + 16] = hi + m;
    }
  } else {
#pragma omp simd
    for (int i = 0; i < 32; ++i) w[i] = float(int8_t(q[i])) * d;
  }
}

template <int KIND, int R>
void row_tile(const Args& a, int64_t r0, int64_t j) {
  const int64_t nb = a.k / 32, qb = KIND == 0 ? 16 : 32;
  const uint8_t* q = a.qs + j * nb * qb;
  float acc[R][32] = {};
  float w[32];
  for (int64_t b = 0; b < nb; ++b) {
    block_weights<KIND>(q + b * qb, a.d[j * nb + b], a.m[j * nb + b], w);
    for (int r = 0; r < R; ++r) {
      const float* x = a.x + (r0 + r) * a.x_stride + b * 32;
#pragma omp simd
      for (int i = 0; i < 32; ++i) acc[r][i] += w[i] * x[i];
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = 0.f;
    for (int i = 0; i < 32; ++i) s += acc[r][i];
    if (a.residual) s += a.residual[(r0 + r) * a.res_stride + j];
    a.out[(r0 + r) * a.n + j] = s;
  }
}
#endif

template <int KIND>
void rows_of_feature(const Args& a, int64_t j) {
  int64_t r = 0;
  for (; r + kTile <= a.rows; r += kTile) row_tile<KIND, kTile>(a, r, j);
  switch (a.rows - r) {
    case 1: row_tile<KIND, 1>(a, r, j); break;
    case 2: row_tile<KIND, 2>(a, r, j); break;
    case 3: row_tile<KIND, 3>(a, r, j); break;
    case 4: row_tile<KIND, 4>(a, r, j); break;
    case 5: row_tile<KIND, 5>(a, r, j); break;
    case 6: row_tile<KIND, 6>(a, r, j); break;
    case 7: row_tile<KIND, 7>(a, r, j); break;
    default: break;
  }
}

template <int KIND>
void qmatmul(const Args& a) {
#pragma omp parallel for num_threads(a.n_threads) schedule(static)
  for (int64_t j = 0; j < a.n; ++j) rows_of_feature<KIND>(a, j);
}
}  // namespace

extern "C" int kvhive_qmatmul(const Args* a) {
  if (a->k % 32 || a->rows < 0 || (a->kind != 0 && a->kind != 1)) return 1;
  if (a->kind == 0) qmatmul<0>(*a); else qmatmul<1>(*a);
  return 0;
}
"""
