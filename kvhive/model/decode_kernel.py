"""Decode attention read straight from the paged KV pool by a small C++ kernel (CPU).

One work item per (sequence, KV head, chunk of keys); the chunks' partial softmaxes merge by their
maxima. The library is built once per machine by ``kvhive.model.native``; without a compiler the
runner gathers the blocks and uses SDPA instead.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvhive.model.native import build_library

if TYPE_CHECKING:
    from kvhive.model.attention import DecodeBatch


class _KernelArgs(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64), ("pool", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("ctx_lens", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("n_seqs", "max_blocks", "num_layers", "layer", "block_size",
                                            "kv_heads", "group", "head_dim")] + [
        ("scale", ctypes.c_float), ("chunk", ctypes.c_int64), ("out", ctypes.c_void_p),
        ("ws", ctypes.c_void_p), ("n_threads", ctypes.c_int)]


class CpuDecodeKernel:
    """Decode attention read straight from the pool (no gather), float32 or bfloat16, on CPU."""

    CHUNK_KEYS = 256        # keys per work item; items are (sequence, kv head, chunk)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvhive_decode_attention
        self._fn.argtypes = [ctypes.POINTER(_KernelArgs), ctypes.c_int]
        self._fn.restype = ctypes.c_int

    @classmethod
    def load(cls, cache_dir: str | None = None) -> CpuDecodeKernel | None:
        """The kernel, compiled on first use per machine into cache_dir; None without a compiler."""
        lib = build_library("decode", _KERNEL_SOURCE,
                            ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"), cache_dir)
        return None if lib is None else cls(lib)

    @staticmethod
    def workspace_size(num_seqs: int, max_context: int, num_heads: int, head_dim: int) -> int:
        """float32 values of partials for a decode batch."""
        chunks = -(-max_context // CpuDecodeKernel.CHUNK_KEYS) + 1
        return num_seqs * num_heads * chunks * (head_dim + 2)

    @staticmethod
    def chunk_keys(block_size: int) -> int:
        """Keys per work item: CHUNK_KEYS rounded up to whole blocks."""
        return -(-CpuDecodeKernel.CHUNK_KEYS // block_size) * block_size

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int, dec: DecodeBatch) -> torch.Tensor:
        """Attention of q [N, heads, head_dim] (rows may be strided) -> [N, heads * head_dim]."""
        n, heads, head_dim = q.shape
        _, num_layers, _, block_size, kv_heads, _ = kv_cache.shape
        out = torch.empty(n, heads * head_dim, dtype=q.dtype)
        args = _KernelArgs(q.data_ptr(), q.stride(0), kv_cache.data_ptr(), dec.block_tables.data_ptr(),
                           dec.context_lens.data_ptr(), n, dec.block_tables.shape[1], num_layers, layer,
                           block_size, kv_heads, heads // kv_heads, head_dim, head_dim ** -0.5,
                           self.chunk_keys(block_size), out.data_ptr(), dec.workspace.data_ptr(),
                           torch.get_num_threads())
        if self._fn(ctypes.byref(args), int(kv_cache.dtype == torch.bfloat16)):
            raise ValueError(f"decode kernel: unsupported shape (group {heads // kv_heads}, "
                             f"head_dim {head_dim})")
        return out


_KERNEL_SOURCE = r"""
// Decode attention read straight from kvhive's KV pool [blocks, layers, 2, block_size, kv_heads, head_dim]:
// one work item per (sequence, kv head, chunk of keys); chunk partials merge by their softmax maxima.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {
inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void to_float(const uint16_t* src, float* dst, int64_t n) {  // bfloat16: the top half of a float
  uint32_t bits[256];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = uint32_t(src[i]) << 16;
  std::memcpy(dst, bits, n * 4);
}
inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void from_float(const float* src, uint16_t* dst, int64_t n) {  // round to nearest even
  uint32_t bits[256];
  std::memcpy(bits, src, n * 4);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = uint16_t((bits[i] + 0x7FFF + ((bits[i] >> 16) & 1)) >> 16);
}

struct Args {
  const void* q; int64_t q_stride; const void* pool; const int64_t* tables; const int64_t* ctx_lens;
  int64_t n_seqs, max_blocks, num_layers, layer, block_size, kv_heads, group, head_dim;
  float scale; int64_t chunk; void* out; float* ws; int n_threads;
};

// Partials of one item into ws: per query of the group, acc[head_dim], max, sum. HD, G: 0 = runtime.
template <typename T, int HD, int G>
void chunk_partials(const Args& a, int64_t n, int64_t h, int64_t begin, int64_t end, float* scores, float* ws) {
  const int64_t hd = HD ? HD : a.head_dim, group = G ? G : a.group, bs = a.block_size, len = end - begin;
  const int64_t row_stride = a.kv_heads * hd, layer_stride = 2 * bs * row_stride;
  const T* pool = static_cast<const T*>(a.pool) + a.layer * layer_stride + h * hd;
  const int64_t* table = a.tables + n * a.max_blocks;
  float q[16 * 256], row[256], acc[16 * 256];
  for (int64_t g = 0; g < group; ++g) {
    to_float(static_cast<const T*>(a.q) + n * a.q_stride + (h * group + g) * hd, q + g * hd, hd);
    for (int64_t d = 0; d < hd; ++d) q[g * hd + d] *= a.scale;
  }
  const T* block = nullptr;                 // chunks start on block boundaries
  for (int64_t j = 0; j < len; ++j) {
    if ((begin + j) % bs == 0) block = pool + table[(begin + j) / bs] * a.num_layers * layer_stride;
    to_float(block + ((begin + j) % bs) * row_stride, row, hd);
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < hd; ++d) s += q[g * hd + d] * row[d];
      scores[g * len + j] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float m = -FLT_MAX, l = 0.f;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, sg[j]);
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < len; ++j) { sg[j] = std::exp(sg[j] - m); l += sg[j]; }
    ws[g * (hd + 2) + hd] = m;
    ws[g * (hd + 2) + hd + 1] = l;
    std::fill(acc + g * hd, acc + (g + 1) * hd, 0.f);
  }
  for (int64_t j = 0; j < len; ++j) {
    if ((begin + j) % bs == 0) block = pool + table[(begin + j) / bs] * a.num_layers * layer_stride + bs * row_stride;
    to_float(block + ((begin + j) % bs) * row_stride, row, hd);
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * len + j];
#pragma omp simd
      for (int64_t d = 0; d < hd; ++d) acc[g * hd + d] += w * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) std::memcpy(ws + g * (hd + 2), acc + g * hd, hd * 4);
}

template <typename T>
using ChunkFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, float*, float*);

template <typename T>
ChunkFn<T> pick(int64_t hd, int64_t g) {
#define CASES(H) if (hd == H) switch (g) { case 1: return chunk_partials<T, H, 1>; \
  case 2: return chunk_partials<T, H, 2>; case 3: return chunk_partials<T, H, 3>; \
  case 4: return chunk_partials<T, H, 4>; case 6: return chunk_partials<T, H, 6>; \
  case 8: return chunk_partials<T, H, 8>; }
  CASES(64) CASES(128)
#undef CASES
  return chunk_partials<T, 0, 0>;
}

template <typename T>
void decode_attention(const Args& a) {
  const int64_t hd = a.head_dim, n_chunks = (a.max_blocks * a.block_size + a.chunk - 1) / a.chunk;
  const int64_t item = a.group * (hd + 2), heads = a.kv_heads * a.group;
  const ChunkFn<T> fn = pick<T>(hd, a.group);
#pragma omp parallel num_threads(a.n_threads)
  {
    float* scores = new float[a.group * a.chunk];
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t n = 0; n < a.n_seqs; ++n)
      for (int64_t h = 0; h < a.kv_heads; ++h)
        for (int64_t c = 0; c < n_chunks; ++c) {
          const int64_t begin = c * a.chunk, end = std::min(a.ctx_lens[n], begin + a.chunk);
          if (begin < end) fn(a, n, h, begin, end, scores, a.ws + ((n * a.kv_heads + h) * n_chunks + c) * item);
        }
    delete[] scores;
#pragma omp for collapse(2)
    for (int64_t n = 0; n < a.n_seqs; ++n)
      for (int64_t qh = 0; qh < heads; ++qh) {
        const int64_t used = (a.ctx_lens[n] + a.chunk - 1) / a.chunk;
        const float* part = a.ws + (n * a.kv_heads + qh / a.group) * n_chunks * item + (qh % a.group) * (hd + 2);
        float m = -FLT_MAX, l = 0.f, o[256] = {0.f};
        for (int64_t c = 0; c < used; ++c) m = std::max(m, part[c * item + hd]);
        for (int64_t c = 0; c < used; ++c) {
          const float f = std::exp(part[c * item + hd] - m);
          l += f * part[c * item + hd + 1];
#pragma omp simd
          for (int64_t d = 0; d < hd; ++d) o[d] += f * part[c * item + d];
        }
        for (int64_t d = 0; d < hd; ++d) o[d] /= l;
        from_float(o, static_cast<T*>(a.out) + (n * heads + qh) * hd, hd);
      }
  }
}
}  // namespace

extern "C" int kvhive_decode_attention(const Args* a, int is_bf16) {
  if (a->group > 16 || a->head_dim > 256 || a->chunk % a->block_size) return 1;
  if (is_bf16) decode_attention<uint16_t>(*a); else decode_attention<float>(*a);
  return 0;
}
"""
