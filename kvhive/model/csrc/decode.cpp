// Decode attention read straight from kvhive's KV pool [blocks, layers, 2, block_size, kv_heads, row].
// The query/output type (float32 or bfloat16) and the pool's row type (float32, bfloat16, or packed
// int8 / E4M3 rows of head_dim codes and a bfloat16 scale: kv_rows.h) are independent template
// parameters; packed rows are dequantised in registers as they are read.
// Work items are (kv head, chunk of keys, sequences): the sequences of a batch whose chunk lies in the
// same pool blocks (a shared cached prefix) are one item, which reads each K/V row once for all of
// them. Each (sequence, head, chunk) leaves a partial softmax; the partials merge by their maxima.
// head_dim 64 with up to 4 queries per KV head (SmolLM2, Llama-style GQA) has an AVX-512 path and
// an AVX2 + FMA path (same work items, online softmax over steps of 32 keys, float32 compute on
// bfloat16, float32 or 8-bit rows); other shapes, and builds with neither, take a generic one.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define KVHIVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVHIVE_AVX2 1
#endif

namespace {
#include "bf16.h"

#include "kv_rows.h"
inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void from_float(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

struct Args {
  const void* q; int64_t q_stride; const void* pool; const int64_t* tables; const int64_t* ctx_lens;
  int64_t n_seqs, max_blocks, num_layers, layer, block_size, kv_heads, group, head_dim;
  float scale; int64_t chunk; void* out; float* ws; int n_threads;
};

// Sequences per work item: a request and up to 15 rows of its draft read its keys once. (Eight
// requests of 600 tokens, each verifying 12 draft tokens, 104 rows: all 30 layers' decode attention
// 11% faster than with items of 8 on an AVX2 EPYC; 4 draft tokens each: even.)
constexpr int64_t kMaxShare = 16;

// One work item: keys [begin, end) of kv head h, chunk c, for sequences seqs[0:count] (same blocks).
struct Work { int64_t h, c, begin, end; const int64_t* seqs; int64_t count, n_chunks; };

// Per-thread scratch: scores [group, chunk], the chunk's row pointers, running softmax states.
struct Scratch { float* scores; const void** rows; float* state; };

// Where the partial of (sequence n, item w) goes: per query of the group, acc[head_dim], max, sum.
inline float* partial(const Args& a, const Work& w, int64_t n) {
  return a.ws + ((n * a.kv_heads + w.h) * w.n_chunks + w.c) * a.group * (a.head_dim + 2);
}

// Generic path, one sequence at a time; queries TQ, rows K (each row dequantised whole). HD, G: 0 = runtime.
template <typename TQ, typename K, int HD, int G>
void chunk_partials(const Args& a, int64_t n, int64_t h, int64_t begin, int64_t end, float* scores, float* ws) {
  const int64_t hd = HD ? HD : a.head_dim, group = G ? G : a.group, bs = a.block_size, len = end - begin;
  const int64_t row_stride = a.kv_heads * row_len<K>(hd), layer_stride = 2 * bs * row_stride;
  const K* pool = static_cast<const K*>(a.pool) + a.layer * layer_stride + h * row_len<K>(hd);
  const int64_t* table = a.tables + n * a.max_blocks;
  float q[16 * 256], row[256], acc[16 * 256];
  for (int64_t g = 0; g < group; ++g) {
    to_float(static_cast<const TQ*>(a.q) + n * a.q_stride + (h * group + g) * hd, q + g * hd, hd);
    for (int64_t d = 0; d < hd; ++d) q[g * hd + d] *= a.scale;
  }
  const K* block = nullptr;                 // chunks start on block boundaries
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

template <typename TQ, typename K, int HD, int G>
void each_sequence(const Args& a, const Work& w, Scratch& tmp) {
  for (int64_t s = 0; s < w.count; ++s)
    chunk_partials<TQ, K, HD, G>(a, w.seqs[s], w.h, w.begin, w.end, tmp.scores, partial(a, w, w.seqs[s]));
}

#if defined(KVHIVE_AVX512) || defined(KVHIVE_AVX2)
constexpr int64_t kStepKeys = 32;  // keys per online-softmax step: their K and V rows stay in L1
constexpr int64_t kAhead = 8;      // rows prefetched ahead into L1
// Rows prefetched ahead into L2, one row per key read: an even stream (a step's rows prefetched in
// one burst read the pool ~25% slower on one core, ~12% on two).
constexpr int64_t kFar = 32;

// The pool is read in block-table order, which hardware prefetchers cannot follow across blocks.
// A packed row (66 bytes, aligned to nothing) spans the lines of its first and last bytes.
template <int HINT = _MM_HINT_T0, typename T>
inline void prefetch_row(const T* p) {
  const char* c = reinterpret_cast<const char*>(p);
  if (kPacked<T>) {
    _mm_prefetch(c, _mm_hint(HINT));
    _mm_prefetch(c + 65, _mm_hint(HINT));
  } else {
    for (int line = 0; line < int(64 * sizeof(T) / 64); ++line) _mm_prefetch(c + 64 * line, _mm_hint(HINT));
  }
}

// Packed rows: the step's per-key K and V scales (0 past nk). Scores are scale_k * (q . codes) and
// the V sums take p * scale_v: the scale factored out of each row's sums, which changes the
// rounding order only (code * scale is exact in float32, see kv_rows.h).
template <typename K>
inline void step_row_scales(const K* const* rows, int64_t j0, int64_t nk, int64_t v_offset, float* sk, float* sv) {
  for (int64_t j = 0; j < kStepKeys; ++j) {
    sk[j] = j < nk ? row_scale(rows[j0 + j], 64) : 0.f;
    sv[j] = j < nk ? row_scale(rows[j0 + j] + v_offset, 64) : 0.f;
  }
}
// p[g][j] *= scale_v[j] for the G queries' probabilities (after their sums were taken).
inline void scale_probs(float* scores, int64_t group, int64_t stride, int64_t nk, const float* sv) {
  for (int64_t g = 0; g < group; ++g)
#pragma omp simd
    for (int64_t j = 0; j < nk; ++j) scores[g * stride + j] *= sv[j];
}
// A packed row's V sums in natural order for the merge, E4M3's unit (kCodeUnit) back in.
inline void natural_order(const float* loaded, float* out, I8) { std::memcpy(out, loaded, 64 * 4); }
inline void natural_order(const float* loaded, float* out, F8) {
  for (int d = 0; d < 64; ++d) out[d] = loaded[d] * kCodeUnit<F8>;
}
#endif

#ifdef KVHIVE_AVX512
#include "avx512_sum16.h"

#include "avx512_exp2.h"

// A row of 64 values as four float32 vectors. bfloat16 rows come out as the even then the odd dims
// of each half (0 2 .. 30 | 1 3 .. 31 | 32 34 .. 62 | 33 35 .. 63): a shift and a mask, no
// shuffles. Dot products with a query loaded the same way do not care; the V sums are put back
// in order once per item (natural_order).
inline void load_row(const float* p, __m512 (&r)[4]) {
  for (int c = 0; c < 4; ++c) r[c] = _mm512_loadu_ps(p + 16 * c);
}
inline void load_row(const uint16_t* p, __m512 (&r)[4]) {
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int c = 0; c < 2; ++c) {
    const __m512i w = _mm512_loadu_si512(p + 32 * c);
    r[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    r[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
  }
}
// Packed rows: the codes in natural order, unscaled (the scale is factored out of the sums); an
// E4M3 byte b becomes the float16 ((b & 0x7F) << 7) | ((b & 0x80) << 8), its value times 2^-8
// (exact for every finite code, subnormals included: E4M3's exponent bias 7 sits 8 below
// float16's 15), and vcvtph2ps widens it. The float16 bits come from b sign-extended to 16 bits,
// shifted left by 7 (the sign lands on bit 15, and on bit 14 too, which the mask clears).
inline void load_row(const I8* p, __m512 (&r)[4]) {
  for (int c = 0; c < 4; ++c)
    r[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c))));
}
inline void load_row(const F8* p, __m512 (&r)[4]) {
  const __m256i bits = _mm256_set1_epi16(int16_t(0xBF80));
  for (int c = 0; c < 4; ++c) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c)));
    r[c] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), bits));
  }
}
// Queries for packed rows: natural order, whatever their type.
inline void load_natural(const float* p, __m512 (&r)[4]) { load_row(p, r); }
inline void load_natural(const uint16_t* p, __m512 (&r)[4]) {
  for (int c = 0; c < 4; ++c)
    r[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c))), 16));
}
inline void natural_order(const float* loaded, float* out, float) { std::memcpy(out, loaded, 64 * 4); }
inline void natural_order(const float* loaded, float* out, uint16_t) {
  for (int half = 0; half < 2; ++half)
    for (int i = 0; i < 16; ++i) {
      out[32 * half + 2 * i] = loaded[32 * half + i];
      out[32 * half + 2 * i + 1] = loaded[32 * half + 16 + i];
    }
}

// part[g][jj] = a vector whose sum is q[g] . row, for G queries loaded by load_queries.
template <int G, typename T>
inline void dot_rows(const __m512 (&q)[G][4], const T* row, __m512 (*part)[16], int jj) {
  __m512 k[4];
  load_row(row, k);
  for (int g = 0; g < G; ++g)
    part[g][jj] = _mm512_fmadd_ps(q[g][3], k[3], _mm512_fmadd_ps(q[g][2], k[2],
                  _mm512_fmadd_ps(q[g][1], k[1], _mm512_mul_ps(q[g][0], k[0]))));
}
template <int G, typename T>
inline void load_queries(const T* first, __m512 (&q)[G][4]) {
  for (int g = 0; g < G; ++g) load_row(first + g * 64, q[g]);
}
template <int G, typename T>
inline void load_natural_queries(const T* first, __m512 (&q)[G][4]) {   // for packed rows
  for (int g = 0; g < G; ++g) load_natural(first + g * 64, q[g]);
}
#ifdef __AVX512BF16__
// bfloat16 keys: pairs of products summed by vdpbf16ps (exact products, float32 sums), with the
// queries' raw bfloat16 pairs in q[g][0:2].
template <int G>
inline void dot_rows(const __m512 (&q)[G][4], const uint16_t* row, __m512 (*part)[16], int jj) {
  const __m512bh k0 = (__m512bh)_mm512_loadu_si512(row), k1 = (__m512bh)_mm512_loadu_si512(row + 32);
  for (int g = 0; g < G; ++g)
    part[g][jj] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[g][0], k0),
                                   (__m512bh)q[g][1], k1);
}
template <int G>
inline void load_queries(const uint16_t* first, __m512 (&q)[G][4]) {
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2; ++c) q[g][c] = _mm512_castsi512_ps(_mm512_loadu_si512(first + g * 64 + 32 * c));
}
#endif

// Scores of one step's keys [j0, j0 + nk) for the G queries: log2(e) * scale * q . k, 16 keys per
// horizontal-sum tree (packed rows: times sk, the keys' scales). The first member of an item
// prefetches the rows the others then find in L1.
template <typename T, int G>
void step_scores(const Args& a, const __m512 (&q)[G][4], const T* const* rows, int64_t len, int64_t j0,
                 int64_t nk, bool first, const float* sk, float* scores) {
  for (int64_t k0 = 0; k0 < nk; k0 += 16) {
    const int nkk = int(std::min<int64_t>(16, nk - k0));
    __m512 part[G][16];
    for (int jj = 0; jj < nkk; ++jj) {
      const int64_t j = j0 + k0 + jj;
      if (first) {
        prefetch_row(rows[std::min(len - 1, j + kAhead)]);
        prefetch_row<_MM_HINT_T1>(rows[std::min(len - 1, j + kFar)]);
      }
      dot_rows(q, rows[j], part, jj);
    }
    __m512 scale = _mm512_set1_ps(a.scale * float(M_LOG2E) * kCodeUnit<T>);
    if (kPacked<T>) scale = _mm512_mul_ps(scale, _mm512_loadu_ps(sk + k0));
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * kStepKeys + k0, _mm512_mul_ps(sum16(part[g], nkk), scale));
  }
}

// Online softmax over one step: scores become 2^(score - new max) (0 past nk); a query's running
// max and sum update in its state; returns how much its earlier V sums shrink.
inline float softmax_step(float* sg, int64_t nk, float* st) {
  constexpr int hd = 64;
  __m512 top = _mm512_set1_ps(st[hd]);
  for (int64_t k0 = 0; k0 < nk; k0 += 16)
    top = _mm512_mask_max_ps(top, __mmask16((1u << std::min<int64_t>(16, nk - k0)) - 1), top, _mm512_loadu_ps(sg + k0));
  const float m = _mm512_reduce_max_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < nk; k0 += 16) {
    const __mmask16 valid = __mmask16((1u << std::min<int64_t>(16, nk - k0)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + k0), _mm512_set1_ps(m))));
    _mm512_storeu_ps(sg + k0, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float rescale = st[hd] == -FLT_MAX ? 0.f : _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(st[hd] - m)));
  st[hd] = m;
  st[hd + 1] = st[hd + 1] * rescale + _mm512_reduce_add_ps(sum);
  return rescale;
}

// state acc = rescale * acc + sum over the step's keys of p_j v_j, in G x 4 vector accumulators.
template <typename T, int G>
void step_values(const T* const* rows, int64_t len, int64_t j0, int64_t nk, int64_t v_offset, bool first,
                 const float* scores, const float (&rescale)[G], float* state) {
  constexpr int64_t kState = 66;
  __m512 acc[G][4];                                   // constant indices only, so: registers
#pragma GCC unroll 16
  for (int i = 0; i < 4 * G; ++i)
    acc[i / 4][i % 4] = _mm512_mul_ps(_mm512_loadu_ps(state + (i / 4) * kState + 16 * (i % 4)),
                                      _mm512_set1_ps(rescale[i / 4]));
  for (int64_t j = 0; j < nk; ++j) {
    if (first) {
      prefetch_row(rows[std::min(len - 1, j0 + j + kAhead)] + v_offset);
      prefetch_row<_MM_HINT_T1>(rows[std::min(len - 1, j0 + j + kFar)] + v_offset);
    }
    __m512 v[4];
    load_row(rows[j0 + j] + v_offset, v);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * kStepKeys + j]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < 4 * G; ++i) _mm512_storeu_ps(state + (i / 4) * kState + 16 * (i % 4), acc[i / 4][i % 4]);
}

// One item for head_dim 64 and G <= 4 queries per kv head: online softmax over steps of kStepKeys
// keys, each step's K and V rows read from memory once and then from L1 by every member sequence.
template <typename TQ, typename T, int G>
void shared_chunk(const Args& a, const Work& w, Scratch& tmp) {
  constexpr int64_t hd = 64, kState = hd + 2;   // state per query: acc (load_row's order), max, sum
  const int64_t bs = a.block_size, len = w.end - w.begin, row_stride = a.kv_heads * row_len<T>(hd);
  const int64_t layer_stride = 2 * bs * row_stride, block_stride = a.num_layers * layer_stride;
  const int64_t v_offset = bs * row_stride;
  const T* pool = static_cast<const T*>(a.pool) + a.layer * layer_stride + w.h * row_len<T>(hd);
  const int64_t* table = a.tables + w.seqs[0] * a.max_blocks;   // every member has these blocks
  const T** rows = reinterpret_cast<const T**>(tmp.rows);
  for (int64_t j = 0; j < len; j += bs) {                       // chunks start on block boundaries
    const T* block = pool + table[(w.begin + j) / bs] * block_stride;
    for (int64_t r = 0; r < std::min(bs, len - j); ++r) rows[j + r] = block + r * row_stride;
  }
  for (int64_t i = 0; i < w.count * G; ++i) {
    std::fill(tmp.state + i * kState, tmp.state + i * kState + hd, 0.f);
    tmp.state[i * kState + hd] = -FLT_MAX;
    tmp.state[i * kState + hd + 1] = 0.f;
  }
  float sk[kStepKeys], sv[kStepKeys];                            // packed rows' scales
  for (int64_t j0 = 0; j0 < len; j0 += kStepKeys) {
    const int64_t nk = std::min(kStepKeys, len - j0);
    if (kPacked<T>) step_row_scales(rows, j0, nk, v_offset, sk, sv);
    if (j0 == 0)
      for (int64_t j = 0; j < std::min(len, kFar); ++j) {
        prefetch_row<_MM_HINT_T1>(rows[j]);
        prefetch_row<_MM_HINT_T1>(rows[j] + v_offset);
      }
    for (int64_t s = 0; s < w.count; ++s) {
      float* state = tmp.state + s * G * kState;
      __m512 q[G][4];
      const TQ* first = static_cast<const TQ*>(a.q) + w.seqs[s] * a.q_stride + w.h * G * hd;
      if (kPacked<T>) load_natural_queries(first, q);
      else load_queries(reinterpret_cast<const T*>(first), q);   // T is TQ for float rows
      step_scores(a, q, rows, len, j0, nk, s == 0, sk, tmp.scores);
      float rescale[G];
      for (int g = 0; g < G; ++g) rescale[g] = softmax_step(tmp.scores + g * kStepKeys, nk, state + g * kState);
      if (kPacked<T>) scale_probs(tmp.scores, G, kStepKeys, nk, sv);
      step_values(rows, len, j0, nk, v_offset, s == 0, tmp.scores, rescale, state);
    }
  }
  for (int64_t s = 0; s < w.count; ++s) {
    float* out = partial(a, w, w.seqs[s]);
    for (int g = 0; g < G; ++g) {
      const float* st = tmp.state + (s * G + g) * kState;
      natural_order(st, out + g * kState, T());
      out[g * kState + hd] = st[hd] * float(M_LN2);           // the merge works in natural log units
      out[g * kState + hd + 1] = st[hd + 1];
    }
  }
}
#elif defined(KVHIVE_AVX2)
#include "avx2_sum8.h"

#include "avx2_exp2.h"

// Vectors c0 .. c0 + N - 1 (N, c0 even) of a row of 64 values, as float32. bfloat16 rows come out
// as the even then the odd dims of each 16 (0 2 .. 14 | 1 3 .. 15 | 16 18 .. 30 | 17 ..): a shift
// and a mask, no shuffles. Dot products with a query loaded the same way do not care; the V sums
// are put back in order once per item (natural_order).
template <int N>
inline void load_vecs(const float* p, int c0, __m256* r) {
  for (int c = 0; c < N; ++c) r[c] = _mm256_loadu_ps(p + 8 * (c0 + c));
}
template <int N>
inline void load_vecs(const uint16_t* p, int c0, __m256* r) {
  const __m256i high = _mm256_set1_epi32(int(0xFFFF0000u));
  for (int c = 0; c < N; c += 2) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 * (c0 + c)));
    r[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    r[c + 1] = _mm256_castsi256_ps(_mm256_and_si256(w, high));
  }
}
// Packed rows: the codes in natural order, unscaled (the scale is factored out of the sums); an
// E4M3 byte becomes a float16 with the value times 2^-8 (as in the AVX-512 path's load_row) and
// F16C widens it.
template <int N>
inline void load_vecs(const I8* p, int c0, __m256* r) {
  for (int c = 0; c < N; ++c)
    r[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (c0 + c)))));
}
template <int N>
inline void load_vecs(const F8* p, int c0, __m256* r) {
  const __m128i bits = _mm_set1_epi16(int16_t(0xBF80));
  for (int c = 0; c < N; ++c) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * (c0 + c))));
    r[c] = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), bits));
  }
}
inline __m256 load_natural(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_natural(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void natural_order(const float* loaded, float* out, float) { std::memcpy(out, loaded, 64 * 4); }
inline void natural_order(const float* loaded, float* out, uint16_t) {
  for (int part = 0; part < 4; ++part)
    for (int i = 0; i < 8; ++i) {
      out[16 * part + 2 * i] = loaded[16 * part + i];
      out[16 * part + 2 * i + 1] = loaded[16 * part + 8 + i];
    }
}

inline __m256 first_lanes(int n) {   // all-ones in lanes 0 .. n - 1
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The G queries of kv head h as float32 in the rows' order (load_vecs' for float rows, natural for
// packed ones), times log2(e) * scale (and E4M3's unit, kCodeUnit).
template <typename TQ, typename K, int G>
inline void load_queries(const Args& a, const TQ* first, float (*q)[64]) {
  const __m256 scale = _mm256_set1_ps(a.scale * float(M_LOG2E) * kCodeUnit<K>);
  for (int g = 0; g < G; ++g) {
    __m256 r[8];
    if (kPacked<K>) for (int c = 0; c < 8; ++c) r[c] = load_natural(first + g * 64 + 8 * c);
    else load_vecs<8>(reinterpret_cast<const K*>(first) + g * 64, 0, r);   // K is TQ for float rows
    for (int c = 0; c < 8; ++c) _mm256_store_ps(q[g] + 8 * c, _mm256_mul_ps(r[c], scale));
  }
}

// Scores of one step's keys [j0, j0 + nk) for the G queries (log2 units), 8 keys per horizontal-sum
// tree (packed rows: times sk, the keys' scales); slots from nk up to the next multiple of 8 get
// -FLT_MAX. The first member of an item prefetches the rows the others then find in L1.
template <typename T, int G>
void step_scores(const float (*q)[64], const T* const* rows, int64_t len, int64_t j0, int64_t nk, bool first,
                 const float* sk, float* scores) {
  for (int64_t k0 = 0; k0 < nk; k0 += 8) {
    const int nkk = int(std::min<int64_t>(8, nk - k0));
    __m256 part[G][8];
    for (int jj = 0; jj < nkk; ++jj) {
      const int64_t j = j0 + k0 + jj;
      if (first) {
        prefetch_row(rows[std::min(len - 1, j + kAhead)]);
        prefetch_row<_MM_HINT_T1>(rows[std::min(len - 1, j + kFar)]);
      }
      __m256 k[8];
      load_vecs<8>(rows[j], 0, k);
      for (int g = 0; g < G; ++g) {           // two chains of four FMAs
        __m256 s0 = _mm256_mul_ps(_mm256_load_ps(q[g]), k[0]), s1 = _mm256_mul_ps(_mm256_load_ps(q[g] + 8), k[1]);
        for (int c = 2; c < 8; c += 2) {
          s0 = _mm256_fmadd_ps(_mm256_load_ps(q[g] + 8 * c), k[c], s0);
          s1 = _mm256_fmadd_ps(_mm256_load_ps(q[g] + 8 * c + 8), k[c + 1], s1);
        }
        part[g][jj] = _mm256_add_ps(s0, s1);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m256 s = sum8(part[g], nkk);
      if (kPacked<T>) s = _mm256_mul_ps(s, _mm256_loadu_ps(sk + k0));
      if (nkk < 8) s = _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), s, first_lanes(nkk));
      _mm256_storeu_ps(scores + g * kStepKeys + k0, s);
    }
  }
}

// Online softmax over one step: scores become 2^(score - new max) (0 past nk); a query's running
// max and sum update in its state; returns how much its earlier V sums shrink.
inline float softmax_step(float* sg, int64_t nk, float* st) {
  constexpr int hd = 64;
  __m256 top = _mm256_set1_ps(st[hd]);
  for (int64_t k0 = 0; k0 < nk; k0 += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sg + k0));
  const float m = hmax(top);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < nk; k0 += 8) {
    __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + k0), _mm256_set1_ps(m)));
    if (nk - k0 < 8) p = _mm256_and_ps(p, first_lanes(int(nk - k0)));
    _mm256_storeu_ps(sg + k0, p);
    sum = _mm256_add_ps(sum, p);
  }
  const float rescale = st[hd] == -FLT_MAX ? 0.f : _mm256_cvtss_f32(exp2_ps(_mm256_set1_ps(st[hd] - m)));
  st[hd] = m;
  st[hd + 1] = st[hd + 1] * rescale + hsum(sum);
  return rescale;
}

// state acc = rescale * acc + sum over the step's keys of p_j v_j. The 64 dims go in passes of
// DC vectors, so the G x DC accumulators, G weights and the V vectors fit the 16 registers; each
// pass reads other columns of the same V rows (L1 after the first).
template <typename T, int G>
void step_values(const T* const* rows, int64_t len, int64_t j0, int64_t nk, int64_t v_offset, bool first,
                 const float* scores, const float (&rescale)[G], float* state) {
  constexpr int64_t kState = 66;
  // float32 V vectors can feed the FMAs from memory; bfloat16 ones take registers to widen
  constexpr int DC = G == 1 ? 8 : G == 2 || (G == 3 && sizeof(T) == 4) ? 4 : 2;
  for (int c0 = 0; c0 < 8; c0 += DC) {
    __m256 acc[G][DC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c)
        acc[g][c] = _mm256_mul_ps(_mm256_loadu_ps(state + g * kState + 8 * (c0 + c)), _mm256_set1_ps(rescale[g]));
    for (int64_t j = 0; j < nk; ++j) {
      if (first && c0 == 0) {
        prefetch_row(rows[std::min(len - 1, j0 + j + kAhead)] + v_offset);
        prefetch_row<_MM_HINT_T1>(rows[std::min(len - 1, j0 + j + kFar)] + v_offset);
      }
      __m256 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(scores + g * kStepKeys + j);
      for (int c = 0; c < DC; c += 2) {        // two V vectors live at a time
        __m256 v[2];
        load_vecs<2>(rows[j0 + j] + v_offset, c0 + c, v);
        for (int g = 0; g < G; ++g) {
          acc[g][c] = _mm256_fmadd_ps(p[g], v[0], acc[g][c]);
          acc[g][c + 1] = _mm256_fmadd_ps(p[g], v[1], acc[g][c + 1]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < DC; ++c) _mm256_storeu_ps(state + g * kState + 8 * (c0 + c), acc[g][c]);
  }
}

// One item for head_dim 64 and G <= 4 queries per kv head: online softmax over steps of kStepKeys
// keys, each step's K and V rows read from memory once and then from L1 by every member sequence.
template <typename TQ, typename T, int G>
void shared_chunk(const Args& a, const Work& w, Scratch& tmp) {
  constexpr int64_t hd = 64, kState = hd + 2;   // state per query: acc (load_vecs' order), max, sum
  const int64_t bs = a.block_size, len = w.end - w.begin, row_stride = a.kv_heads * row_len<T>(hd);
  const int64_t layer_stride = 2 * bs * row_stride, block_stride = a.num_layers * layer_stride;
  const int64_t v_offset = bs * row_stride;
  const T* pool = static_cast<const T*>(a.pool) + a.layer * layer_stride + w.h * row_len<T>(hd);
  const int64_t* table = a.tables + w.seqs[0] * a.max_blocks;   // every member has these blocks
  const T** rows = reinterpret_cast<const T**>(tmp.rows);
  for (int64_t j = 0; j < len; j += bs) {                       // chunks start on block boundaries
    const T* block = pool + table[(w.begin + j) / bs] * block_stride;
    for (int64_t r = 0; r < std::min(bs, len - j); ++r) rows[j + r] = block + r * row_stride;
  }
  for (int64_t i = 0; i < w.count * G; ++i) {
    std::fill(tmp.state + i * kState, tmp.state + i * kState + hd, 0.f);
    tmp.state[i * kState + hd] = -FLT_MAX;
    tmp.state[i * kState + hd + 1] = 0.f;
  }
  alignas(32) float q[G][64];
  float sk[kStepKeys], sv[kStepKeys];                            // packed rows' scales
  for (int64_t j0 = 0; j0 < len; j0 += kStepKeys) {
    const int64_t nk = std::min(kStepKeys, len - j0);
    if (kPacked<T>) step_row_scales(rows, j0, nk, v_offset, sk, sv);
    if (j0 == 0)
      for (int64_t j = 0; j < std::min(len, kFar); ++j) {
        prefetch_row<_MM_HINT_T1>(rows[j]);
        prefetch_row<_MM_HINT_T1>(rows[j] + v_offset);
      }
    for (int64_t s = 0; s < w.count; ++s) {
      float* state = tmp.state + s * G * kState;
      load_queries<TQ, T, G>(a, static_cast<const TQ*>(a.q) + w.seqs[s] * a.q_stride + w.h * G * hd, q);
      step_scores<T, G>(q, rows, len, j0, nk, s == 0, sk, tmp.scores);
      float rescale[G];
      for (int g = 0; g < G; ++g) rescale[g] = softmax_step(tmp.scores + g * kStepKeys, nk, state + g * kState);
      if (kPacked<T>) scale_probs(tmp.scores, G, kStepKeys, nk, sv);
      step_values(rows, len, j0, nk, v_offset, s == 0, tmp.scores, rescale, state);
    }
  }
  for (int64_t s = 0; s < w.count; ++s) {
    float* out = partial(a, w, w.seqs[s]);
    for (int g = 0; g < G; ++g) {
      const float* st = tmp.state + (s * G + g) * kState;
      natural_order(st, out + g * kState, T());
      out[g * kState + hd] = st[hd] * float(M_LN2);           // the merge works in natural log units
      out[g * kState + hd + 1] = st[hd + 1];
    }
  }
}
#endif

using ItemFn = void (*)(const Args&, const Work&, Scratch&);

template <typename TQ, typename K>
ItemFn pick(int64_t hd, int64_t g) {
#if defined(KVHIVE_AVX512) || defined(KVHIVE_AVX2)
  if (hd == 64) switch (g) { case 1: return shared_chunk<TQ, K, 1>; case 2: return shared_chunk<TQ, K, 2>;
    case 3: return shared_chunk<TQ, K, 3>; case 4: return shared_chunk<TQ, K, 4>; }
#endif
#define CASES(H) if (hd == H) switch (g) { case 1: return each_sequence<TQ, K, H, 1>; \
  case 2: return each_sequence<TQ, K, H, 2>; case 3: return each_sequence<TQ, K, H, 3>; \
  case 4: return each_sequence<TQ, K, H, 4>; case 6: return each_sequence<TQ, K, H, 6>; \
  case 8: return each_sequence<TQ, K, H, 8>; }
  CASES(64) CASES(128)
#undef CASES
  return each_sequence<TQ, K, 0, 0>;
}

// Keys [begin, end) of sequence n in chunk c; empty past its context.
inline void chunk_range(const Args& a, int64_t n, int64_t c, int64_t& begin, int64_t& end) {
  begin = c * a.chunk;
  end = std::min(a.ctx_lens[n], begin + a.chunk);
}

// Whether sequences n and m read the same keys, from the same blocks, in chunk c.
inline bool same_chunk(const Args& a, int64_t n, int64_t m, int64_t c) {
  int64_t begin, end, begin_m, end_m;
  chunk_range(a, n, c, begin, end);
  chunk_range(a, m, c, begin_m, end_m);
  if (end != end_m) return false;
  const int64_t* tn = a.tables + n * a.max_blocks;
  const int64_t* tm = a.tables + m * a.max_blocks;
  for (int64_t b = begin / a.block_size; b * a.block_size < end; ++b)
    if (tn[b] != tm[b]) return false;
  return true;
}

// The work items, groups x heads; a group is up to kMaxShare sequences that read chunk c from the
// same blocks, members[first : first + count].
std::vector<Work> plan_work(const Args& a, int64_t n_chunks, std::vector<int64_t>& members) {
  struct Group { int64_t c, first, count; };
  std::vector<Group> groups;
  for (int64_t c = 0; c < n_chunks; ++c) {
    std::vector<int64_t> left, rest;
    for (int64_t n = 0; n < a.n_seqs; ++n) {
      int64_t begin, end;
      chunk_range(a, n, c, begin, end);
      if (begin < end) left.push_back(n);
    }
    while (!left.empty()) {
      const int64_t first = int64_t(members.size());
      members.push_back(left[0]);
      rest.clear();
      for (size_t i = 1; i < left.size(); ++i) {
        if (int64_t(members.size()) - first < kMaxShare && same_chunk(a, left[0], left[i], c)) members.push_back(left[i]);
        else rest.push_back(left[i]);
      }
      groups.push_back(Group{c, first, int64_t(members.size()) - first});
      left.swap(rest);
    }
  }
  std::vector<Work> items;
  for (const Group& g : groups)             // a group's heads back to back: threads taking items in
    for (int64_t h = 0; h < a.kv_heads; ++h) {   // turn read the same blocks' rows together
      int64_t begin, end;
      chunk_range(a, members[g.first], g.c, begin, end);
      items.push_back(Work{h, g.c, begin, end, members.data() + g.first, g.count, n_chunks});
    }
  return items;
}

// Queries and output TQ (float or uint16_t: bfloat16), pool rows K (TQ, I8 or F8).
template <typename TQ, typename K>
void decode_attention(const Args& a) {
  const int64_t hd = a.head_dim, n_chunks = (a.max_blocks * a.block_size + a.chunk - 1) / a.chunk;
  const int64_t item = a.group * (hd + 2), heads = a.kv_heads * a.group;
  const ItemFn fn = pick<TQ, K>(hd, a.group);
  std::vector<int64_t> members;
  const std::vector<Work> items = plan_work(a, n_chunks, members);
#pragma omp parallel num_threads(a.n_threads)
  {
    Scratch tmp{new float[a.group * a.chunk], new const void*[a.chunk], new float[kMaxShare * item]};
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) fn(a, items[i], tmp);
    delete[] tmp.scores;
    delete[] tmp.rows;
    delete[] tmp.state;
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
        from_float(o, static_cast<TQ*>(a.out) + (n * heads + qh) * hd, hd);
      }
  }
}

enum KvType { kKvFloat = 0, kKvBf16 = 1, kKvInt8 = 2, kKvFp8 = 3 };   // the pool's row types

template <typename TQ>
int decode_rows_of(const Args& a, int kv_type) {
  switch (kv_type) {
    case kKvFloat: if (!std::is_same<TQ, float>::value) return 2; decode_attention<TQ, TQ>(a); return 0;
    case kKvBf16: if (!std::is_same<TQ, uint16_t>::value) return 2; decode_attention<TQ, TQ>(a); return 0;
    case kKvInt8: decode_attention<TQ, I8>(a); return 0;
    case kKvFp8: decode_attention<TQ, F8>(a); return 0;
  }
  return 2;
}
}  // namespace

// q_is_bf16: queries and output bfloat16 (else float32). kv_type: the pool's rows (kKv*). Returns 0;
// 1: an unsupported shape; 2: an unsupported pair of types (a float pool is read by its own type's
// queries only).
extern "C" int kvhive_decode_attention(const Args* a, int q_is_bf16, int kv_type) {
  if (a->group > 16 || a->head_dim > 256 || a->chunk % a->block_size) return 1;
  return q_is_bf16 ? decode_rows_of<uint16_t>(*a, kv_type) : decode_rows_of<float>(*a, kv_type);
}
