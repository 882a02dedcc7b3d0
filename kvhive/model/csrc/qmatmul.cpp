// residual + x @ W^T with W in GGUF blocks of 32 along k: Q4_1 (w = d*q + m, q in 0..15) or
// Q8_0 (w = d*q, q int8). Each weight is rebuilt in float32 exactly as gguf's dequantiser does
// (product, then sum: built without FP contraction; d is a float16 value, so d*q is exact and a
// fused d*q + m rounds the same) and multiplied into a tile of R rows x F
// features held in R*F vector accumulators, so one rebuilt weight vector feeds R FMAs and one x
// load feeds F. A tile's R*F accumulators are reduced together (a transpose-add tree) into a
// scratch [rows, kChunk]; the residual and the bfloat16 rounding are applied per chunk of features.
// Threads take contiguous ranges of features; x (at most a few rows) stays in L1/L2.
// Three builds of the tile: AVX-512 (16-lane vectors, up to 24 accumulators), AVX2 + FMA (8-lane
// vectors, up to 12 accumulators) and plain C++ for the compiler to vectorise. All rebuild the same
// float32 weights; they differ only in the order the products are summed.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include <omp.h>
#if defined(__AVX512F__) && !defined(KVHIVE_PORTABLE)
#include <immintrin.h>
#define KVHIVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && !defined(KVHIVE_PORTABLE)
#include <immintrin.h>
#define KVHIVE_AVX2 1
#endif

namespace {
struct Args {
  const void* x; int64_t x_stride, rows; const uint8_t* qs; const float* d; const float* m;
  int64_t n, k; int kind; const void* residual; int64_t res_stride; void* out; int n_threads;
  int x_bf16, res_bf16;   // x and out are bfloat16 (else float32); residual is bfloat16 (else float32)
};

// What a tile reads: float32 x rows (stride xs) and the weight's blocks (nb per feature).
struct Tiles { const float* x; int64_t xs, nb; const uint8_t* qs; const float* d; const float* m; };

constexpr int64_t kChunk = 32;    // features per epilogue pass (scratch [rows, kChunk] per thread)
#ifdef KVHIVE_AVX512
constexpr int64_t kMaxRows = 12;  // rows per tile
constexpr int kMaxAcc = 24;       // accumulators per tile (R * F): 3/4 of the vector registers
constexpr int kMaxAccFeatures = kMaxAcc;   // ... for a tile of several features
#elif defined(KVHIVE_AVX2)
constexpr int64_t kMaxRows = 12;
constexpr int kMaxAcc = 12;       // of the 16 vector registers: one weight vector and its scales beside
constexpr int kMaxAccFeatures = 8;         // tiles of 2 and 4 features: 4 and 2 rows, whose x fits L1
#else
constexpr int64_t kMaxRows = 8;
constexpr int kMaxAcc = 8;
constexpr int kMaxAccFeatures = kMaxAcc;
#endif

#include "bf16.h"

#ifdef KVHIVE_AVX512
// The 32 weights of one block as two vectors (values 0-15 and 16-31). Q4_1 looks the nibbles up
// in the block's 16 possible weights (d*q + m for q = 0..15, rounded as gguf rounds them).
template <int KIND>
inline void block_weights(const uint8_t* q, float d, float m, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(d);
  if (KIND == 0) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(levels, vd), _mm512_set1_ps(m));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm512_permutexvar_ps(bytes, table);                        // uses the low 4 bits only
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vd);
  }
}

#include "avx512_sum16.h"

// sums[i] = horizontal sum of acc[i], for N accumulators.
template <int N>
inline void sum_all(const __m512* acc, float* sums) {
  if (N <= 2) {
    for (int i = 0; i < N; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
    return;
  }
  for (int base = 0; base < N; base += 16) _mm512_storeu_ps(sums + base, sum16(acc + base, std::min(16, N - base)));
}

// dst[r * stride + f] = x[r0 + r] . w[j0 + f] for an R x F tile.
template <int KIND, int R, int F>
void tile(const Tiles& t, int64_t r0, int64_t j0, float* dst, int64_t stride) {
  constexpr int64_t QB = KIND == 0 ? 16 : 32;
  __m512 acc[R * F];
  for (int i = 0; i < R * F; ++i) acc[i] = _mm512_setzero_ps();
  const float* x = t.x + r0 * t.xs;
  const uint8_t* q = t.qs + j0 * t.nb * QB;
  const float* d = t.d + j0 * t.nb;
  const float* m = t.m + j0 * t.nb;
  for (int64_t b = 0; b < t.nb; ++b) {
    for (int f = 0; f < F; ++f) {            // the same block of the tile after next: DRAM latency
      const int64_t ahead = (2 * F + f) * t.nb + b;
      _mm_prefetch(reinterpret_cast<const char*>(q + ahead * QB), _MM_HINT_T0);
      if (b % 16 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(d + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(m + ahead), _MM_HINT_T0);
      }
    }
    __m512 w0[F], w1[F];
    for (int f = 0; f < F; ++f) block_weights<KIND>(q + (f * t.nb + b) * QB, d[f * t.nb + b], m[f * t.nb + b], w0[f], w1[f]);
    for (int r = 0; r < R; ++r) {
      __m512 x0 = _mm512_loadu_ps(x + r * t.xs + b * 32), x1 = _mm512_loadu_ps(x + r * t.xs + b * 32 + 16);
      if (F > 1) __asm__("" : "+v"(x0), "+v"(x1));   // one load per x vector, not one per feature
      for (int f = 0; f < F; ++f) {
        acc[r * F + f] = _mm512_fmadd_ps(w0[f], x0, acc[r * F + f]);
        acc[r * F + f] = _mm512_fmadd_ps(w1[f], x1, acc[r * F + f]);
      }
    }
  }
  alignas(64) float sums[(R * F + 15) / 16 * 16];
  sum_all<R * F>(acc, sums);
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) dst[r * stride + f] = sums[r * F + f];
}

// Features per tile for a step of `rows` rows: F x min(rows, 12, 24 / F) accumulators. (One Q8_0
// row streams its large blocks faster one feature at a time: measured on the 49152 x 576 LM head.)
// Tiles of up to 12 rows x 2 features, not 8: each tile rebuilds every weight, so with 8 a 9th row
// (a decode step's one draft token) took a second pass of rebuilding for itself alone. All
// layers' projections of the default model in float32 on an AMD EPYC (2 threads), 8 x 2 tiles
// against 12 x 2: 9 rows 14.0 vs 12.6 ms, 12 rows 18.4 vs 16.0, 24 rows 34.9 vs 31.5 (8 rows 11.3
// both). One feature per tile of 16 rows was slower (16 rows 34.9 ms): an x load then feeds one
// feature's two FMAs.
inline int features_per_tile(int kind, int64_t rows, int64_t) { return kind == 1 && rows == 1 ? 1 : rows <= 4 ? 4 : 2; }
#elif defined(KVHIVE_AVX2)
// Vector i of a block's 32 weights (values 8i to 8i+7): d*q + m (Q4_1) or d*q (Q8_0). Q4_1 byte j
// holds value j in its low nibble and value j + 16 in its high nibble. d is a float16 value (11
// significant bits) and |q| <= 128, so d*q is exact in float32 and the one rounding of fmadd(q, d, m)
// gives gguf's multiply-then-add weight bit for bit. Tiles build one vector at a time, leaving the
// registers to their sums.
template <int KIND>
inline __m256 block_vector(const uint8_t* q, __m256 vd, __m256 vm, int i) {
  if (KIND == 0) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (i & 1))));
    const __m256i v = i < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(b, 4);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), vd, vm);
  }
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)))), vd);
}

#include "avx2_sum8.h"

// dst[r * stride + f] = x[r0 + r] . w[j0 + f] for an R x F tile. Small tiles keep two
// accumulators per (row, feature), so the four FMAs of a block are two chains, not one; every
// larger tile adds them in the same order, so a row's sums do not depend on the tile's size.
template <int KIND, int R, int F>
void tile(const Tiles& t, int64_t r0, int64_t j0, float* dst, int64_t stride) {
  constexpr int64_t QB = KIND == 0 ? 16 : 32;
  constexpr int A = R * F <= 4 ? 2 : 1, N = R * F;
  __m256 acc[A][N];
  for (int a = 0; a < A; ++a)
    for (int i = 0; i < N; ++i) acc[a][i] = _mm256_setzero_ps();
  const float* x = t.x + r0 * t.xs;
  const uint8_t* q = t.qs + j0 * t.nb * QB;
  const float* d = t.d + j0 * t.nb;
  const float* m = t.m + j0 * t.nb;
  for (int64_t b = 0; b < t.nb; ++b) {
    for (int f = 0; f < F; ++f) {            // the same block of the tile after next: DRAM latency
      const int64_t ahead = (2 * F + f) * t.nb + b;
      for (int64_t line = 0; line < QB; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + ahead * QB + line), _MM_HINT_T0);
      if (b % 16 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(d + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(m + ahead), _MM_HINT_T0);
      }
    }
    for (int f = 0; f < F; ++f) {
      const uint8_t* qb = q + (f * t.nb + b) * QB;
      const __m256 vd = _mm256_set1_ps(d[f * t.nb + b]), vm = _mm256_set1_ps(KIND == 0 ? m[f * t.nb + b] : 0.f);
      for (int i = 0; i < 4; ++i) {
        const __m256 w = block_vector<KIND>(qb, vd, vm, i);
        for (int r = 0; r < R; ++r)
          acc[i % A][r * F + f] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * t.xs + b * 32 + 8 * i),
                                                  acc[i % A][r * F + f]);
      }
    }
  }
  if (A == 2)
    for (int i = 0; i < N; ++i) acc[0][i] = _mm256_add_ps(acc[0][i], acc[A - 1][i]);
  alignas(32) float sums[(N + 7) / 8 * 8];
  for (int base = 0; base < N; base += 8) _mm256_store_ps(sums + base, sum8(acc[0] + base, std::min(8, N - base)));
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < F; ++f) dst[r * stride + f] = sums[r * F + f];
}

// Features per tile for a step of `rows` rows of length k: F x min(rows, rows_per_tile(F)) accumulators. (One
// or two Q8_0 rows stream their large blocks faster one feature at a time: measured on the LM head.
// Past 4 rows one feature serves up to 12 rows per rebuilt weight while their x stays in L1; longer rows
// take tiles of 4 rows x 2 features, whose x fits and feeds two features per load: measured on the
// 576 x 1536 down projection.) One feature's tiles take up to 12 rows, so a decode step of eight
// requests and one draft token rebuilds the weights once, not twice (8 + 1 rows, the second pass
// paying for the whole rebuild for one row). All layers' projections of the default model in
// float32 on an AVX2-only AMD EPYC (2 threads), 12-row tiles against 8-row ones, median of 15
// paired runs: 9 rows -9%, 10 rows -8%, 11 rows -2%, 12 and 16 rows even (8 rows unchanged).
// Longer rows keep 4 x 2 tiles: 12 x 1 tiles of the down projection were even with them.
inline int features_per_tile(int kind, int64_t rows, int64_t k) {
  constexpr int64_t kL1Floats = 8192;   // 32 KB of x rows: what L1 holds beside the streamed blocks
  return kind == 1 && rows <= 2 ? 1 : rows <= 2 ? 4 : rows <= 4 || std::min(rows, kMaxRows) * k > kL1Floats ? 2 : 1;
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

template <int KIND, int R, int F>
void tile(const Tiles& t, int64_t r0, int64_t j0, float* dst, int64_t stride) {
  const int64_t QB = KIND == 0 ? 16 : 32;
  for (int f = 0; f < F; ++f) {
    const int64_t j = j0 + f;
    float acc[R][32] = {};
    float w[32];
    for (int64_t b = 0; b < t.nb; ++b) {
      block_weights<KIND>(t.qs + (j * t.nb + b) * QB, t.d[j * t.nb + b], t.m[j * t.nb + b], w);
      for (int r = 0; r < R; ++r) {
        const float* x = t.x + (r0 + r) * t.xs + b * 32;
#pragma omp simd
        for (int i = 0; i < 32; ++i) acc[r][i] += w[i] * x[i];
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += acc[r][i];
      dst[r * stride + f] = s;
    }
  }
}

inline int features_per_tile(int, int64_t, int64_t) { return 1; }
#endif

// The most rows a tile of f features takes.
constexpr int64_t rows_per_tile(int f) { return std::min<int64_t>(kMaxRows, (f == 1 ? kMaxAcc : kMaxAccFeatures) / f); }

using TileFn = void (*)(const Tiles&, int64_t, int64_t, float*, int64_t);

// The R x F tile for `rows` rows; rows <= min(kMaxRows, kMaxAcc / F).
template <int KIND, int F, int R = 1>
TileFn tile_for(int64_t rows) {
  if constexpr (R > kMaxRows || R * F > kMaxAcc) return nullptr;
  else return rows == R ? tile<KIND, R, F> : tile_for<KIND, F, R + 1>(rows);
}

// out[rows, j0:j0+nf] = sums (+ residual), rounded to bfloat16 where out is.
void finish(const Args& a, const float* sums, int64_t j0, int64_t nf) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const float* s = sums + r * kChunk;
    float row[kChunk];
    if (!a.residual) {
      std::memcpy(row, s, nf * 4);
    } else if (a.res_bf16) {
      const uint16_t* res = static_cast<const uint16_t*>(a.residual) + r * a.res_stride + j0;
      for (int64_t j = 0; j < nf; ++j) row[j] = s[j] + bf16_to_float(res[j]);
    } else {
      const float* res = static_cast<const float*>(a.residual) + r * a.res_stride + j0;
      for (int64_t j = 0; j < nf; ++j) row[j] = s[j] + res[j];
    }
    if (a.x_bf16) {
      uint16_t* out = static_cast<uint16_t*>(a.out) + r * a.n + j0;
      for (int64_t j = 0; j < nf; ++j) out[j] = float_to_bf16(row[j]);
    } else {
      std::memcpy(static_cast<float*>(a.out) + r * a.n + j0, row, nf * 4);
    }
  }
}

template <int KIND, int F>
void qmatmul(const Args& a, const Tiles& t) {
  // As few passes over the weights as tiles allow, their rows shared out evenly (16 rows in
  // tiles of at most 12: two of 8, whose x rows stay in L1, not 12 and 4).
  const int64_t passes = (a.rows + rows_per_tile(F) - 1) / rows_per_tile(F);
#pragma omp parallel num_threads(a.n_threads)
  {
    const int64_t nt = omp_get_num_threads(), id = omp_get_thread_num(), tiles = (a.n + F - 1) / F;
    const int64_t begin = std::min(a.n, tiles * id / nt * F), end = std::min(a.n, tiles * (id + 1) / nt * F);
    std::vector<float> sums(a.rows * kChunk);
    for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
      const int64_t c1 = std::min(end, c0 + kChunk);
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t r0 = a.rows * p / passes, nr = a.rows * (p + 1) / passes - r0;
        const TileFn full = tile_for<KIND, F>(nr), single = tile_for<KIND, 1>(nr);
        float* dst = sums.data() + r0 * kChunk - c0;
        int64_t j = c0;
        for (; j + F <= c1; j += F) full(t, r0, j, dst + j, kChunk);
        for (; j < c1; ++j) single(t, r0, j, dst + j, kChunk);
      }
      finish(a, sums.data(), c0, c1 - c0);
    }
  }
}

template <int KIND>
void qmatmul(const Args& a) {
  Tiles t{static_cast<const float*>(a.x), a.x_stride, a.k / 32, a.qs, a.d, a.m};
  std::vector<float> x;
  if (a.x_bf16) {                               // x as float32 once (a few rows)
    x.resize(a.rows * a.k);
    const uint16_t* src = static_cast<const uint16_t*>(a.x);
    for (int64_t r = 0; r < a.rows; ++r)
      for (int64_t i = 0; i < a.k; ++i) x[r * a.k + i] = bf16_to_float(src[r * a.x_stride + i]);
    t.x = x.data();
    t.xs = a.k;
  }
  switch (features_per_tile(KIND, a.rows, a.k)) {
    case 4: qmatmul<KIND, 4>(a, t); break;
    case 2: qmatmul<KIND, 2>(a, t); break;
    default: qmatmul<KIND, 1>(a, t); break;
  }
}
}  // namespace

extern "C" int kvhive_qmatmul(const Args* a) {
  if (a->k % 32 || a->rows < 0 || (a->kind != 0 && a->kind != 1)) return 1;
  if (a->rows == 0 || a->n == 0) return 0;
  if (a->kind == 0) qmatmul<0>(*a); else qmatmul<1>(*a);
  return 0;
}
