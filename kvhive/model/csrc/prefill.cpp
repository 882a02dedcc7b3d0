// Causal prefill attention over kvhive's KV pool [blocks, layers, 2, block_size, kv_heads, head_dim].
// Two paths, chosen by the ISA level the library is compiled for:
//   AVX-512: 16-wide float32 for float32 pools; bf16 pools on vdpbf16ps where AVX512-BF16 is there,
//            or (mode 2) widened to float32 as they are packed and run as a float32 pool.
//   AVX2 + FMA: 8-wide float32 for both dtypes; it also serves bf16 pools at the avx512 level
//            (built without AVX512-BF16).
//   8-bit pools (int8 or E4M3 rows of head_dim codes + a bf16 scale, kvhive.model.kv_quant), at
//            either level: each row dequantised into float32 as its tile is packed, then the float32
//            path; queries and output float32 or bf16, whichever the model runs.
// Without AVX2 + FMA (the portable level) there is no path and kvhive_prefill_caps() is 0.
// Phase 1 packs each KV head's keys (and, but for a float32 pool, its values) into tiles of kTile keys in the
// caller's workspace:
//   float32 (AVX-512 float32 pools and the wide bf16 path; AVX2 for both dtypes, bf16 widened by
//            a 16-bit shift; 8-bit pools at both levels, dequantised):
//            K as [d][kTile keys]; V as [kTile keys][d] (a float32 pool's V rows are already
//            [key][d] and are read where they lie)
//   bf16 (AVX512-BF16): K as [d/2][kTile keys][2] (dword = the pair of dims a vdpbf16ps multiplies),
//            V as [kTile/2 key pairs][d][2]
// Phase 2: one item per (KV head, 16 query tokens); its rows are (token, head of the group), so a
// tile is read once for the whole group. For each key tile and each block of rows (8 for AVX-512,
// 6 for AVX2): scores, an online softmax in float32 (exp2 with scaled logits), then the value
// products into float32 accumulators. Output is in the queries' dtype (bf16 rounded to nearest even).
#include <immintrin.h>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The hot helpers (transposes, score and value products, softmax steps) are always inlined: the
// 8-bit instantiations would otherwise outgrow GCC's inlining budget and leave some of them calls.
#define KVHIVE_INLINE inline __attribute__((always_inline))

namespace {
#include "bf16.h"
struct Args {
  const void* q; int64_t q_stride; const void* pool; const int64_t* table;
  int64_t n, start_pos, num_layers, layer, block_size, kv_heads, group, head_dim;
  float scale; void* out; void* ws; int n_threads;
};

constexpr int kTile = 32;   // keys per tile
constexpr int kQTok = 16;   // query tokens per item

// K row of `key` (V row: block_size rows later); ROW: elements per (token, KV head) row.
template <typename T, int ROW>
inline const T* key_row(const Args& a, int64_t key, int kv) {
  const int64_t row = a.kv_heads * ROW;
  const int64_t block = a.table[key / a.block_size];
  return static_cast<const T*>(a.pool) +
         ((block * a.num_layers + a.layer) * 2 + kv) * a.block_size * row + (key % a.block_size) * row;
}

// Stands in for rows of keys past ctx (up to 128 floats; an 8-bit row of zeros has scale 0).
alignas(64) const uint32_t kZeroRow[128] = {};

// K and V rows of the kTile keys of tile t for KV head h; keys past ctx read kZeroRow. A pool row
// holds ROW elements: HD values, or for an 8-bit pool HD codes and a 2-byte scale.
template <typename T, int HD, int ROW = HD>
inline void tile_rows(const Args& a, int64_t h, int64_t t, int64_t ctx, const T** k, const T** v) {
  const int64_t stride = a.kv_heads * ROW, v_off = a.block_size * stride;   // V rows: block_size rows after K's
  int64_t off = t * kTile % a.block_size;   // the key's row within its pool block
  const T* row = nullptr;
  for (int j = 0; j < kTile; ++j, ++off) {
    const int64_t key = t * kTile + j;
    if (key >= ctx) {
      k[j] = v[j] = reinterpret_cast<const T*>(kZeroRow);
      continue;
    }
    if (j == 0 || off == a.block_size) {   // first key of the tile or of a pool block: look it up
      row = key_row<T, ROW>(a, key, 0) + h * ROW;
      off %= a.block_size;
    } else {
      row += stride;
    }
    k[j] = row;
    v[j] = row + v_off;
  }
}

// 8-bit KV rows (kvhive.model.kv_quant): HD codes, then the row's bfloat16 scale; value =
// decode(code) * scale. The code types say how a byte decodes; kScale folds E4M3's 2^8 (its byte
// is read as float16 bits, which are the value times 2^-8) into the row's scale.
struct Int8Codes { static constexpr float kScale = 1.f; };
struct E4M3Codes { static constexpr float kScale = 256.f; };

template <typename C>
inline float row_scale(const uint8_t* row, int hd) {   // unaligned: rows are HD + 2 bytes apart
  uint16_t bits;
  std::memcpy(&bits, row + hd, 2);
  return bf16_to_float(bits) * C::kScale;
}

#if defined(__AVX512F__)
#include "avx512_exp2.h"

constexpr int kNV = kTile / 16;   // score vectors per row and tile
constexpr int kRB = 8;      // rows per register block

// In-place transpose of a 16x16 dword matrix: r[i] holds row i before, column i after.
KVHIVE_INLINE void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {   // interleave dwords of row pairs
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // then qwords: 4x4 blocks transposed within each 128-bit lane
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {       // then transpose the 4x4 grid of lanes: column 4L+c = lane L of r[c + 4i]
    const __m512i a0 = _mm512_shuffle_i32x4(r[c], r[c + 4], 0x44), a1 = _mm512_shuffle_i32x4(r[c], r[c + 4], 0xEE);
    const __m512i b0 = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0x44), b1 = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0xEE);
    t[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[c + 4] = _mm512_shuffle_i32x4(a0, b0, 0xDD);
    t[c + 8] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[c + 12] = _mm512_shuffle_i32x4(a1, b1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// K tile transpose: kTile rows of W dwords -> [W][kTile] (dword w of key j at w * kTile + j),
// in 16 keys x 16 dwords blocks (W = 8 loads half rows and keeps half the columns). The row
// pointers are read as their own type T (reading them as uint32_t* would break strict aliasing).
template <int W, typename T>
KVHIVE_INLINE void transpose_rows(const T* const* rows, uint32_t* kt) {
  constexpr int kC = W < 16 ? W : 16;
  constexpr __mmask16 mask = __mmask16((1u << kC) - 1);
  for (int w = 0; w < W; w += kC)
    for (int g = 0; g < kTile; g += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_epi32(mask, reinterpret_cast<const uint32_t*>(rows[g + i]) + w);
      transpose16x16(r);
      for (int i = 0; i < kC; ++i) _mm512_storeu_si512(kt + (w + i) * kTile + g, r[i]);
    }
}

// Per-dtype parts: packing one tile, scores of kRB rows, value products of R rows into their accumulators.
// V is read where it lies (the tile's rows in the pool) or from the packed tile, as D::VSrc says.
struct F32 {
  using T = float;                    // the pool's and the output's element
  using P = float;                    // the packed tiles' and the queries' element
  using VSrc = const float* const*;   // the tile's kTile V rows in the pool
  template <int HD>
  static void pack(const Args& a, int64_t h, int64_t t, int64_t ctx, float* kt, float*) {
    const float *k[kTile], *v[kTile];
    tile_rows<float, HD>(a, h, t, ctx, k, v);
    transpose_rows<HD>(k, reinterpret_cast<uint32_t*>(kt));   // K: [d][kTile]; V stays in the pool
  }
  template <int HD>
  static VSrc value_rows(const Args& a, int64_t h, int64_t t, int64_t ctx, const float*, const float** v) {
    const float* k[kTile];
    tile_rows<float, HD>(a, h, t, ctx, k, v);
    return v;
  }
  template <int HD>
  static KVHIVE_INLINE void scores(const float* q, const float* kt, __m512 (*s)[kNV]) {   // q: kRB rows of HD
    for (int r = 0; r < kRB; ++r)
      for (int v = 0; v < kNV; ++v) s[r][v] = _mm512_setzero_ps();
    for (int d = 0; d < HD; ++d) {
      __m512 k[kNV];
      for (int v = 0; v < kNV; ++v) k[v] = _mm512_loadu_ps(kt + d * kTile + v * 16);
      for (int r = 0; r < kRB; ++r) {
        const __m512 b = _mm512_set1_ps(q[r * HD + d]);
        for (int v = 0; v < kNV; ++v) s[r][v] = _mm512_fmadd_ps(b, k[v], s[r][v]);
      }
    }
  }
  template <int HD, int R>
  static KVHIVE_INLINE void values(__m512 (*p)[kNV], VSrc vrow, __m512 (*o)[HD / 16]) {
    alignas(64) float pv[R][kTile];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNV; ++v) _mm512_store_ps(pv[r] + v * 16, p[r][v]);
    for (int j = 0; j < kTile; ++j) {
      __m512 vv[HD / 16];
      for (int c = 0; c < HD / 16; ++c) vv[c] = _mm512_loadu_ps(vrow[j] + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(pv[r][j]);
        for (int c = 0; c < HD / 16; ++c) o[r][c] = _mm512_fmadd_ps(w, vv[c], o[r][c]);
      }
    }
  }
  static void load_q(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * 4); }
  static void store(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
};

// A bfloat16 pool computed in float32 at 16 lanes: keys and values widened once as their tile is
// packed (K as [d][kTile], V as [kTile][d]) and the queries as they are loaded; scores,
// probabilities and value products as for a float32 pool; the output rounded to bf16. Where
// vdpbf16ps runs no faster than two float32 FMAs (Intel with AMX measured 1.4x slower on the
// pairs path) this is the faster bf16 path; CpuPrefillKernel measures which one a CPU gets.
struct WideBF16 {
  using T = uint16_t;
  using P = float;
  using VSrc = const float* const*;   // the packed tile's kTile V rows
  static void widen(const uint16_t* src, float* dst, int64_t n) {   // n: a multiple of 16
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
  }
  template <int HD>
  static void pack(const Args& a, int64_t h, int64_t t, int64_t ctx, float* kt, float* vt) {
    const uint16_t *k[kTile], *v[kTile];
    tile_rows<uint16_t, HD>(a, h, t, ctx, k, v);
    alignas(64) float kw[kTile][HD];
    const float* rows[kTile];
    for (int j = 0; j < kTile; ++j) {
      widen(k[j], kw[j], HD);
      widen(v[j], vt + j * HD, HD);
      rows[j] = kw[j];
    }
    transpose_rows<HD>(rows, reinterpret_cast<uint32_t*>(kt));
  }
  template <int HD>
  static VSrc value_rows(const Args&, int64_t, int64_t, int64_t, const float* vt, const float** v) {
    for (int j = 0; j < kTile; ++j) v[j] = vt + j * HD;
    return v;
  }
  template <int HD>
  static void scores(const float* q, const float* kt, __m512 (*s)[kNV]) { F32::scores<HD>(q, kt, s); }
  template <int HD, int R>
  static void values(__m512 (*p)[kNV], VSrc vrow, __m512 (*o)[HD / 16]) { F32::values<HD, R>(p, vrow, o); }
  static void load_q(float* dst, const uint16_t* src, int64_t n) { widen(src, dst, n); }
  static void store(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
};

// 16 codes as float32 times the row's scale s (C::kScale folded in): int8 sign-extended and
// converted; an E4M3 byte b as the float16 ((b & 0x7f) << 7) | ((b & 0x80) << 8), which is its
// value times 2^-8 for every finite code (normal or subnormal). Both products are exact.
inline __m512 decode16(const uint8_t* p, __m512 s, Int8Codes) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
}
inline __m512 decode16(const uint8_t* p, __m512 s, E4M3Codes) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), s);
}

// An 8-bit pool (C: its codes) with queries and output of type Q (float32, or bf16 as uint16_t),
// computed in float32 at 16 lanes as WideBF16 is: each row dequantised as its tile is packed (K as
// [d][kTile], V as [kTile][d]), so only the tiles, never the whole context, are ever float32.
template <typename Q, typename C>
struct Quant8 {
  using T = Q;
  using P = float;
  using VSrc = const float* const*;   // the packed tile's kTile V rows
  using QIO = typename std::conditional<std::is_same<Q, float>::value, F32, WideBF16>::type;
  template <int HD>
  static void decode_row(const uint8_t* row, float* dst) {
    const __m512 s = _mm512_set1_ps(row_scale<C>(row, HD));
    for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(dst + d, decode16(row + d, s, C{}));
  }
  template <int HD>
  static void pack(const Args& a, int64_t h, int64_t t, int64_t ctx, float* kt, float* vt) {
    const uint8_t *k[kTile], *v[kTile];
    tile_rows<uint8_t, HD, HD + 2>(a, h, t, ctx, k, v);
    alignas(64) float kw[kTile][HD];
    const float* rows[kTile];
    for (int j = 0; j < kTile; ++j) {
      decode_row<HD>(k[j], kw[j]);
      decode_row<HD>(v[j], vt + j * HD);
      rows[j] = kw[j];
    }
    transpose_rows<HD>(rows, reinterpret_cast<uint32_t*>(kt));
  }
  template <int HD>
  static VSrc value_rows(const Args& a, int64_t h, int64_t t, int64_t ctx, const float* vt, const float** v) {
    return WideBF16::value_rows<HD>(a, h, t, ctx, vt, v);
  }
  template <int HD>
  static void scores(const float* q, const float* kt, __m512 (*s)[kNV]) { F32::scores<HD>(q, kt, s); }
  template <int HD, int R>
  static void values(__m512 (*p)[kNV], VSrc vrow, __m512 (*o)[HD / 16]) { F32::values<HD, R>(p, vrow, o); }
  static void load_q(float* dst, const Q* src, int64_t n) { QIO::load_q(dst, src, n); }
  static void store(const float* src, Q* dst, int64_t n) { QIO::store(src, dst, n); }
};

#if defined(__AVX512BF16__)
struct BF16 {
  using T = uint16_t;
  using P = uint16_t;
  using VSrc = const uint16_t*;   // the packed tile
  static void load_q(uint16_t* dst, const uint16_t* src, int64_t n) { std::memcpy(dst, src, n * 2); }
  template <int HD>
  static VSrc value_rows(const Args&, int64_t, int64_t, int64_t, const uint16_t* vt, const uint16_t**) { return vt; }
  template <int HD>
  static void pack(const Args& a, int64_t h, int64_t t, int64_t ctx, uint16_t* kt, uint16_t* vt) {
    const uint16_t *k[kTile], *v[kTile];
    tile_rows<uint16_t, HD>(a, h, t, ctx, k, v);
    // K: rows of HD/2 dwords (dim pairs) -> [HD/2][kTile].
    transpose_rows<HD / 2>(k, reinterpret_cast<uint32_t*>(kt));
    // V: keys 2p and 2p+1 interleaved per dim, 16 dims at a time (zero-extend to dwords, merge).
    for (int p = 0; p < kTile / 2; ++p)
      for (int d = 0; d < HD; d += 16) {
        const __m512i even = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2 * p] + d)));
        const __m512i odd = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[2 * p + 1] + d)));
        _mm512_storeu_si512(vt + (p * HD + d) * 2, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
      }
  }
  template <int HD>
  static void scores(const uint16_t* q, const uint16_t* kt, __m512 (*s)[kNV]) {
    const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q);
    for (int r = 0; r < kRB; ++r)
      for (int v = 0; v < kNV; ++v) s[r][v] = _mm512_setzero_ps();
    for (int dp = 0; dp < HD / 2; ++dp) {
      __m512bh k[kNV];
      for (int v = 0; v < kNV; ++v) k[v] = (__m512bh)_mm512_loadu_si512(kt + (dp * kTile + v * 16) * 2);
      for (int r = 0; r < kRB; ++r) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32(q32[r * HD / 2 + dp]);
        for (int v = 0; v < kNV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], b, k[v]);
      }
    }
  }
  template <int HD, int R>
  static void values(__m512 (*p)[kNV], const uint16_t* vt, __m512 (*o)[HD / 16]) {
    alignas(64) uint32_t pp[R][kTile / 2];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kNV; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r] + v * 8), (__m256i)_mm512_cvtneps_pbh(p[r][v]));
    for (int kp = 0; kp < kTile / 2; ++kp) {
      __m512bh vv[HD / 16];
      for (int c = 0; c < HD / 16; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + (kp * HD + c * 16) * 2);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[r][kp]);
        for (int c = 0; c < HD / 16; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], w, vv[c]);
      }
    }
  }
  static void store(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
};
#endif

// One row's online-softmax step over one tile: raw scores s (kNV vectors of 16 keys from key0 on),
// keys outside [lo, hi] hidden (lo < 0: the whole tile is visible). Leaves the tile's probabilities
// in s, updates the row's max m and its per-lane sum l, and returns the factor (1 or less) by which
// the row's earlier accumulator must be scaled.
KVHIVE_INLINE float softmax_step(__m512* s, int64_t key0, int64_t lo, int64_t hi, float scale, float& m, __m512& l) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 seen[kNV];
  __m512 mx = _mm512_set1_ps(-FLT_MAX);
  for (int v = 0; v < kNV; ++v) {
    s[v] = _mm512_mul_ps(s[v], _mm512_set1_ps(scale));
    seen[v] = 0xFFFF;
    if (lo >= 0) {
      const __m512i keys = _mm512_add_epi32(lane, _mm512_set1_epi32(int(key0 + v * 16)));
      seen[v] = _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32(int(hi))) &
                _mm512_cmpge_epi32_mask(keys, _mm512_set1_epi32(int(lo)));
      s[v] = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), seen[v], s[v]);
    }
    mx = _mm512_max_ps(mx, s[v]);
  }
  const float m_old = m, m_tile = _mm512_reduce_max_ps(mx);
  const float m_new = m_old > m_tile ? m_old : m_tile;
  float alpha = 1.f;
  if (m_new > m_old) {
    alpha = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(m_old - m_new)));
    l = _mm512_mul_ps(l, _mm512_set1_ps(alpha));
    m = m_new;
  }
  for (int v = 0; v < kNV; ++v) {
    s[v] = _mm512_maskz_mov_ps(seen[v], exp2_ps(_mm512_sub_ps(s[v], _mm512_set1_ps(m_new))));
    l = _mm512_add_ps(l, s[v]);
  }
  return alpha;
}

// Value products of R rows over one tile: o[r] = o[r] * alpha[r] + p[r] . V, the R x HD float32
// accumulators held in registers so that each V vector loaded serves every row.
template <typename D, int HD, int R>
KVHIVE_INLINE void values(__m512 (*p)[kNV], const float* alpha, typename D::VSrc vt, float* o) {
  __m512 acc[R][HD / 16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < HD / 16; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_load_ps(o + r * HD + c * 16), _mm512_set1_ps(alpha[r]));
  D::template values<HD, R>(p, vt, acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < HD / 16; ++c) _mm512_store_ps(o + r * HD + c * 16, acc[r][c]);
}

template <typename D, int HD>
void prefill(const Args& a) {
  using T = typename D::T;
  using P = typename D::P;
  const int64_t ctx = a.start_pos + a.n, tiles = (ctx + kTile - 1) / kTile, heads = a.kv_heads * a.group;
  const int64_t tile_elems = kTile * HD;
  constexpr int kRV = HD >= 128 ? 2 : HD >= 64 ? 4 : 8;   // rows per value block: 16 accumulators
  P* kpack = static_cast<P*>(a.ws);                            // [kv_heads][tiles][tile_elems]
  P* vpack = kpack + a.kv_heads * tiles * tile_elems;
  const int64_t q_items = (a.n + kQTok - 1) / kQTok, rows_max = (kQTok * a.group + kRB - 1) / kRB * kRB;
  const float scale = a.scale * 1.4426950408889634f;          // scores in log2 units
#pragma omp parallel num_threads(a.n_threads)
  {
    // Each thread packs a run of whole tiles for every KV head: it streams contiguous pool rows.
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t h = 0; h < a.kv_heads; ++h)
        D::template pack<HD>(a, h, t, ctx, kpack + (h * tiles + t) * tile_elems, vpack + (h * tiles + t) * tile_elems);
    P* qb = new P[rows_max * HD];
    float* o = static_cast<float*>(_mm_malloc(rows_max * HD * sizeof(float), 64));
    float* m = new float[rows_max];
    __m512* l = static_cast<__m512*>(_mm_malloc(rows_max * sizeof(__m512), 64));
    int64_t* pos = new int64_t[rows_max];
    // Later query tiles see more keys: hand them out first.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t qi = q_items - 1; qi >= 0; --qi)
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        const int64_t t0 = qi * kQTok, ntok = (a.n - t0 < kQTok) ? a.n - t0 : kQTok;
        const int64_t rows = ntok * a.group, rows_pad = (rows + kRB - 1) / kRB * kRB;
        for (int64_t r = 0; r < rows_pad; ++r) {
          if (r < rows) {
            const int64_t t = r / a.group, g = r % a.group;
            D::load_q(qb + r * HD, static_cast<const T*>(a.q) + (t0 + t) * a.q_stride + (h * a.group + g) * HD, HD);
            pos[r] = a.start_pos + t0 + t;
          } else {
            std::memset(qb + r * HD, 0, HD * sizeof(P));
            pos[r] = a.start_pos + t0 + ntok - 1;
          }
          m[r] = -FLT_MAX;
          l[r] = _mm512_setzero_ps();
        }
        std::memset(o, 0, rows_pad * HD * sizeof(float));
        const int64_t last = a.start_pos + t0 + ntok - 1;   // the item's last position
        for (int64_t t = 0; t * kTile <= last; ++t) {
          const P* kt = kpack + (h * tiles + t) * tile_elems;
          const P* vrows[kTile];
          const typename D::VSrc vt = D::template value_rows<HD>(a, h, t, ctx, vpack + (h * tiles + t) * tile_elems, vrows);
          const bool diagonal = t * kTile + kTile - 1 > a.start_pos + t0;   // some key past some row
          for (int64_t rb = 0; rb < rows_pad; rb += kRB) {
            __m512 s[kRB][kNV];
            float alpha[kRB];
            D::template scores<HD>(qb + rb * HD, kt, s);
            for (int r = 0; r < kRB; ++r)
              alpha[r] = softmax_step(s[r], t * kTile, diagonal ? 0 : -1, pos[rb + r], scale, m[rb + r], l[rb + r]);
            for (int r = 0; r < kRB; r += kRV)
              values<D, HD, kRV>(s + r, alpha + r, vt, o + (rb + r) * HD);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t tk = r / a.group, g = r % a.group;
          float* orow = o + r * HD;
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
          for (int c = 0; c < HD / 16; ++c) _mm512_store_ps(orow + c * 16, _mm512_mul_ps(_mm512_load_ps(orow + c * 16), inv));
          D::store(orow, static_cast<T*>(a.out) + (t0 + tk) * heads * HD + (h * a.group + g) * HD, HD);
        }
      }
    delete[] qb; _mm_free(o); delete[] m; _mm_free(l); delete[] pos;
  }
}

template <typename D>
int run(const Args& a) {
  switch (a.head_dim) {
    case 16: prefill<D, 16>(a); return 0;
    case 32: prefill<D, 32>(a); return 0;
    case 64: prefill<D, 64>(a); return 0;
    case 128: prefill<D, 128>(a); return 0;
    default: return 1;
  }
}
#endif

// AVX2 + FMA: 8-wide float32 throughout. Compiled wherever vdpbf16ps is not: it serves both dtypes
// at the avx2 level and bf16 pools at the avx512 level.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define KVHIVE_PREFILL_AVX2 1
#include "avx2_exp2.h"

namespace avx2 {
constexpr int kRows = 6;            // rows per register block: 6 x 16 float32 = 12 accumulators
constexpr int kVecs = kTile / 8;    // score vectors per row and tile

// 8 values as float32: a plain load, or bf16 widened to the high half of each dword.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// 8 float32 stored as the pool's dtype; bf16 rounds to nearest even with NaN kept a NaN (as bf16.h).
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(uint16_t* p, __m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// In-place transpose of an 8x8 float32 matrix: r[i] holds row i before, column i after.
KVHIVE_INLINE void transpose8x8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {   // interleave row pairs within each 128-bit lane
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {   // then pairs of pairs: lane L of u[i + c] is column 4L + c of rows i..i+3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {      // then join the rows 0..3 and 4..7 halves of each column
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}

// 8 codes as float32 times the row's scale s (as decode16 at AVX-512; F16C converts E4M3's float16).
inline __m256 decode8(const uint8_t* p, __m256 s, Int8Codes) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
}
inline __m256 decode8(const uint8_t* p, __m256 s, E4M3Codes) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), s);
}

template <typename C, int HD>
inline void decode_row(const uint8_t* row, float* dst) {   // one 8-bit row's HD values as float32
  const __m256 s = _mm256_set1_ps(row_scale<C>(row, HD));
  for (int d = 0; d < HD; d += 8) _mm256_storeu_ps(dst + d, decode8(row + d, s, C{}));
}

// kTile K rows (float32, or bf16 widened) transposed into kt as [HD][kTile]: dim d of key j at d * kTile + j.
template <typename T, int HD>
KVHIVE_INLINE void transpose_keys(const T* const* k, float* kt) {
  for (int g = 0; g < kTile; g += 8)
    for (int d = 0; d < HD; d += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(k[g + i] + d);
      transpose8x8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d + i) * kTile + g, r[i]);
    }
}

// One tile of KV head h packed as float32 (bf16 widened, 8-bit rows dequantised once here, not in
// the products): K as [HD][kTile]; V as [kTile][HD] unless the pool is float32 (K = float: its V
// rows are read where they lie, value_rows). K: the pool's row kind (float, uint16_t for bf16,
// Int8Codes or E4M3Codes for 8-bit rows).
template <typename K, int HD>
void pack(const Args& a, int64_t h, int64_t t, int64_t ctx, float* kt, float* vt) {
  if constexpr (std::is_same<K, float>::value || std::is_same<K, uint16_t>::value) {
    const K *k[kTile], *v[kTile];
    tile_rows<K, HD>(a, h, t, ctx, k, v);
    transpose_keys<K, HD>(k, kt);
    if constexpr (!std::is_same<K, float>::value)
      for (int j = 0; j < kTile; ++j)
        for (int d = 0; d < HD; d += 8) _mm256_storeu_ps(vt + j * HD + d, load8(v[j] + d));
  } else {
    const uint8_t *k[kTile], *v[kTile];
    tile_rows<uint8_t, HD, HD + 2>(a, h, t, ctx, k, v);
    alignas(32) float kw[kTile][HD];
    const float* rows[kTile];
    for (int j = 0; j < kTile; ++j) {
      decode_row<K, HD>(k[j], kw[j]);
      decode_row<K, HD>(v[j], vt + j * HD);
      rows[j] = kw[j];
    }
    transpose_keys<float, HD>(rows, kt);
  }
}

// The kTile V rows of tile t as float32: a float32 pool's own rows, else the packed tile's.
template <typename K, int HD>
inline void value_rows(const Args& a, int64_t h, int64_t t, int64_t ctx, const float* vt, const float** v) {
  if constexpr (std::is_same<K, float>::value) {
    const float* k[kTile];
    tile_rows<float, HD>(a, h, t, ctx, k, v);
  } else {
    for (int j = 0; j < kTile; ++j) v[j] = vt + j * HD;
  }
}

// Raw scores of kRows query rows (q: kRows rows of HD, already scaled) against one packed K tile,
// into s[kRows][kTile]: 16 keys at a time, 6 x 2 accumulators.
template <int HD>
KVHIVE_INLINE void scores(const float* q, const float* kt, float (*s)[kTile]) {
  for (int k0 = 0; k0 < kTile; k0 += 16) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int d = 0; d < HD; ++d) {
      const __m256 k0v = _mm256_loadu_ps(kt + d * kTile + k0), k1v = _mm256_loadu_ps(kt + d * kTile + k0 + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 b = _mm256_broadcast_ss(q + r * HD + d);
        acc[r][0] = _mm256_fmadd_ps(b, k0v, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(b, k1v, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_store_ps(s[r] + k0, acc[r][0]);
      _mm256_store_ps(s[r] + k0 + 8, acc[r][1]);
    }
  }
}

// One row's online-softmax step over one tile: s holds the tile's kTile scores (log2 units) of keys
// key0.. and is left holding their probabilities; with kMasked, keys past `last` are hidden.
// Updates the row's max m and per-lane sum l, and returns the factor (1 or less) by which the row's
// earlier accumulator must be scaled.
template <bool kMasked>
KVHIVE_INLINE float softmax_step(float* s, int64_t key0, int64_t last, float& m, __m256& l) {
  __m256 x[kVecs], hidden[kVecs];
  __m256 mx = _mm256_set1_ps(-FLT_MAX);
  for (int v = 0; v < kVecs; ++v) {
    x[v] = _mm256_load_ps(s + v * 8);
    if (kMasked) {
      const __m256i keys = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(int(key0 + v * 8)));
      hidden[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, _mm256_set1_epi32(int(last))));
      x[v] = _mm256_blendv_ps(x[v], _mm256_set1_ps(-FLT_MAX), hidden[v]);
    }
    mx = _mm256_max_ps(mx, x[v]);
  }
  mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 0x01));   // every lane: the tile's max
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
  mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
  const float m_old = m, m_tile = _mm256_cvtss_f32(mx);
  float alpha = 1.f;
  if (m_tile > m_old) {
    alpha = _mm256_cvtss_f32(exp2_ps(_mm256_set1_ps(m_old - m_tile)));
    l = _mm256_mul_ps(l, _mm256_set1_ps(alpha));
    m = m_tile;
  }
  const __m256 m_new = _mm256_set1_ps(m);
  for (int v = 0; v < kVecs; ++v) {
    __m256 p = exp2_ps(_mm256_sub_ps(x[v], m_new));
    if (kMasked) p = _mm256_andnot_ps(hidden[v], p);
    l = _mm256_add_ps(l, p);
    _mm256_store_ps(s + v * 8, p);
  }
  return alpha;
}

// Value products of kRows rows over one tile: o[r] = o[r] * alpha[r] + p[r] . V, 16 dims at a time
// (6 x 2 accumulators), so that each V vector loaded serves every row.
template <int HD>
KVHIVE_INLINE void values(const float (*p)[kTile], const float* alpha, const float* const* v, float* o) {
  for (int c = 0; c < HD; c += 16) {
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) {
      const __m256 a = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_load_ps(o + r * HD + c), a);
      acc[r][1] = _mm256_mul_ps(_mm256_load_ps(o + r * HD + c + 8), a);
    }
    for (int j = 0; j < kTile; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v[j] + c), v1 = _mm256_loadu_ps(v[j] + c + 8);
      for (int r = 0; r < kRows; ++r) {
        const __m256 w = _mm256_broadcast_ss(p[r] + j);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      _mm256_store_ps(o + r * HD + c, acc[r][0]);
      _mm256_store_ps(o + r * HD + c + 8, acc[r][1]);
    }
  }
}

// T: the queries' and output's element (float, or uint16_t for bf16); K: the pool's row kind (pack).
template <typename T, typename K, int HD>
void prefill(const Args& a) {
  const int64_t ctx = a.start_pos + a.n, tiles = (ctx + kTile - 1) / kTile, heads = a.kv_heads * a.group;
  const int64_t tile_elems = kTile * HD;
  float* kpack = static_cast<float*>(a.ws);                    // [kv_heads][tiles][tile_elems] float32
  float* vpack = kpack + a.kv_heads * tiles * tile_elems;
  const int64_t q_items = (a.n + kQTok - 1) / kQTok, rows_max = (kQTok * a.group + kRows - 1) / kRows * kRows;
  const __m256 qscale = _mm256_set1_ps(a.scale * 1.4426950408889634f);   // scores in log2 units
#pragma omp parallel num_threads(a.n_threads)
  {
    // Each thread packs a run of whole tiles for every KV head: it streams contiguous pool rows.
#pragma omp for collapse(2) schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t h = 0; h < a.kv_heads; ++h)
        pack<K, HD>(a, h, t, ctx, kpack + (h * tiles + t) * tile_elems, vpack + (h * tiles + t) * tile_elems);
    float* qb = static_cast<float*>(_mm_malloc(rows_max * HD * sizeof(float), 32));   // scaled float32 queries
    float* o = static_cast<float*>(_mm_malloc(rows_max * HD * sizeof(float), 32));
    float* m = new float[rows_max];
    __m256* l = static_cast<__m256*>(_mm_malloc(rows_max * sizeof(__m256), 32));
    int64_t* pos = new int64_t[rows_max];
    alignas(32) float s[kRows][kTile];
    // Later query tiles see more keys: hand them out first.
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t qi = q_items - 1; qi >= 0; --qi)
      for (int64_t h = 0; h < a.kv_heads; ++h) {
        const int64_t t0 = qi * kQTok, ntok = (a.n - t0 < kQTok) ? a.n - t0 : kQTok;
        const int64_t rows = ntok * a.group, rows_pad = (rows + kRows - 1) / kRows * kRows;
        for (int64_t r = 0; r < rows_pad; ++r) {
          float* qr = qb + r * HD;
          if (r < rows) {
            const int64_t tk = r / a.group, g = r % a.group;
            const T* src = static_cast<const T*>(a.q) + (t0 + tk) * a.q_stride + (h * a.group + g) * HD;
            for (int d = 0; d < HD; d += 8) _mm256_store_ps(qr + d, _mm256_mul_ps(load8(src + d), qscale));
            pos[r] = a.start_pos + t0 + tk;
          } else {
            std::memset(qr, 0, HD * sizeof(float));
            pos[r] = a.start_pos + t0 + ntok - 1;
          }
          m[r] = -FLT_MAX;
          l[r] = _mm256_setzero_ps();
        }
        std::memset(o, 0, rows_pad * HD * sizeof(float));
        const int64_t last = a.start_pos + t0 + ntok - 1;   // the item's last position
        for (int64_t t = 0; t * kTile <= last; ++t) {
          const float* kt = kpack + (h * tiles + t) * tile_elems;
          const float* v[kTile];
          value_rows<K, HD>(a, h, t, ctx, vpack + (h * tiles + t) * tile_elems, v);
          const bool diagonal = t * kTile + kTile - 1 > a.start_pos + t0;   // some key past some row
          for (int64_t rb = 0; rb < rows_pad; rb += kRows) {
            float alpha[kRows];
            scores<HD>(qb + rb * HD, kt, s);
            for (int r = 0; r < kRows; ++r)
              alpha[r] = diagonal ? softmax_step<true>(s[r], t * kTile, pos[rb + r], m[rb + r], l[rb + r])
                                  : softmax_step<false>(s[r], t * kTile, 0, m[rb + r], l[rb + r]);
            values<HD>(s, alpha, v, o + rb * HD);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t tk = r / a.group, g = r % a.group;
          __m256 sum = _mm256_add_ps(l[r], _mm256_permute2f128_ps(l[r], l[r], 0x01));
          sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0x4E));
          sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0xB1));
          const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), sum);
          T* dst = static_cast<T*>(a.out) + (t0 + tk) * heads * HD + (h * a.group + g) * HD;
          for (int d = 0; d < HD; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_load_ps(o + r * HD + d), inv));
        }
      }
    _mm_free(qb); _mm_free(o); delete[] m; _mm_free(l); delete[] pos;
  }
}

// avx2:: qualified: argument-dependent lookup on Args would also find the AVX-512 prefill.
template <typename T, typename K = T>
int run(const Args& a) {
  switch (a.head_dim) {
    case 16: avx2::prefill<T, K, 16>(a); return 0;
    case 32: avx2::prefill<T, K, 32>(a); return 0;
    case 64: avx2::prefill<T, K, 64>(a); return 0;
    case 128: avx2::prefill<T, K, 128>(a); return 0;
    default: return 1;
  }
}
}  // namespace avx2
#endif
}  // namespace

// Capability bits: 1 float32 pools, 2 bf16 pools, 4 bf16 tiles packed as float32 (the workspace
// then takes 4 bytes per packed element for both dtypes), 8 a second bf16 path computed in float32
// at 16 lanes (mode 2 below; its workspace also takes 4 bytes an element), 16 8-bit pools (int8
// and E4M3 rows, float32 or bf16 queries; packed as float32: 4 bytes an element).
extern "C" int kvhive_prefill_caps() {
  int caps = 0;
#if defined(__AVX512F__) || defined(KVHIVE_PREFILL_AVX2)
  caps |= 1 | 16;
#endif
#if defined(__AVX512F__)
  caps |= 8;
#endif
#if defined(__AVX512BF16__)
  caps |= 2;
#elif defined(KVHIVE_PREFILL_AVX2)
  caps |= 2 | 4;
#endif
  return caps;
}

namespace {
// An 8-bit pool (modes 3..6: int8 or E4M3 rows, float32 or bf16 queries), in float32 at 16 lanes
// where AVX-512 is there, else at 8.
int run_8bit(const Args& a, int mode) {
#if defined(__AVX512F__)
  switch (mode) {
    case 3: return run<Quant8<float, Int8Codes>>(a);
    case 4: return run<Quant8<uint16_t, Int8Codes>>(a);
    case 5: return run<Quant8<float, E4M3Codes>>(a);
    case 6: return run<Quant8<uint16_t, E4M3Codes>>(a);
  }
#elif defined(KVHIVE_PREFILL_AVX2)
  switch (mode) {
    case 3: return avx2::run<float, Int8Codes>(a);
    case 4: return avx2::run<uint16_t, Int8Codes>(a);
    case 5: return avx2::run<float, E4M3Codes>(a);
    case 6: return avx2::run<uint16_t, E4M3Codes>(a);
  }
#endif
  (void)a, (void)mode;
  return 1;
}
}  // namespace

// mode: 0 a float32 pool; 1 a bf16 pool on the build's own bf16 path; 2 a bf16 pool widened to
// float32 at 16 lanes (caps bit 8); 3 / 4 an int8 pool with float32 / bf16 queries; 5 / 6 an E4M3
// pool with float32 / bf16 queries (caps bit 16). The output has the queries' dtype.
extern "C" int kvhive_prefill_attention(const Args* a, int mode) {
  if (a->n <= 0 || a->group <= 0 || mode < 0 || mode > 6) return 1;
  if (mode >= 3) return run_8bit(*a, mode);
#if defined(__AVX512F__)
  if (mode == 2) return run<WideBF16>(*a);
#endif
  const int is_bf16 = mode != 0;
#if defined(__AVX512BF16__)
  if (is_bf16) return run<BF16>(*a);
#elif defined(KVHIVE_PREFILL_AVX2)
  if (is_bf16) return avx2::run<uint16_t>(*a);
#endif
#if defined(__AVX512F__)
  if (!is_bf16) return run<F32>(*a);
#elif defined(KVHIVE_PREFILL_AVX2)
  if (!is_bf16) return avx2::run<float>(*a);
#endif
  (void)is_bf16;
  return 1;
}
