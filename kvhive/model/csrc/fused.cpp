// Fused elementwise steps of a Llama layer, float32 or bfloat16 (is_bf16), rows split over threads.
// SiLU has AVX-512 and AVX2 + FMA paths (a polynomial exp2); RMSNorm, RoPE and SiLU's tail are
// plain loops that the compiler vectorises for the build's ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVHIVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVHIVE_AVX2 1
#endif

namespace {
#include "bf16.h"
inline float round_bf(float f) { return bf16_to_float(float_to_bf16(f)); }

template <typename T> inline float ld(const T* p, int64_t i);
template <> inline float ld<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float ld<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void st(float* p, int64_t i, float v) { p[i] = v; }
inline void st(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
template <typename T> inline float rnd(float v) { return sizeof(T) == 2 ? round_bf(v) : v; }

// out = w * round(x * rsqrt(mean(x^2) + eps)), statistics in float32 (Hugging Face's LlamaRMSNorm).
template <typename T>
void rms_norm(const T* x, int64_t xs, const T* w, T* out, int64_t rows, int64_t h, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * xs;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) { const float v = ld(xr, i); ss += v * v; }
    const float inv = 1.f / std::sqrt(ss / float(h) + eps);
    T* o = out + r * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) st(o, i, ld(w, i) * rnd<T>(ld(xr, i) * inv));
  }
}

#ifdef KVHIVE_AVX512
#include "avx512_exp2.h"
inline __m512 exp_ps(__m512 x) { return exp2_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, uint16_t*) {   // to bf16 and back, nearest even
  const __m512i b = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                                     _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16(v, p)), 16)));
}
#elif defined(KVHIVE_AVX2)
#include "avx2_exp2.h"
inline __m256 exp_ps(__m256 x) { return exp2_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 round8(__m256 v, float*) { return v; }
inline __m256 round8(__m256 v, uint16_t*) {    // to bf16 and back, nearest even
  const __m256i b = _mm256_castps_si256(v);
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)),
                                     _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {    // the rounded top halves, packed (no saturation: < 2^16)
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round8(v, p)), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}
#endif

// out = round(silu(gate)) * up, gate and up the two halves of each row.
template <typename T>
void silu_mul(const T* gu, int64_t gs, T* out, int64_t rows, int64_t inter, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gu + r * gs;
    T* o = out + r * inter;
    int64_t i = 0;
#ifdef KVHIVE_AVX512
    for (; i + 16 <= inter; i += 16) {
      const __m512 v = load16(g + i);
      const __m512 silu = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
      store16(o + i, _mm512_mul_ps(round16(silu, o), load16(g + inter + i)));
    }
#elif defined(KVHIVE_AVX2)
    for (; i + 8 <= inter; i += 8) {
      const __m256 v = load8(g + i);
      const __m256 silu = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v))));
      store8(o + i, _mm256_mul_ps(round8(silu, o), load8(g + inter + i)));
    }
#endif
    for (; i < inter; ++i) {
      const float v = ld(g, i);
      st(o, i, rnd<T>(v / (1.f + std::exp(-v))) * ld(g, inter + i));
    }
  }
}

// x' = round(x * cos) + roll(x, hd/2) * sin_signed, per head, in place.
template <typename T>
void rope(T* qk, int64_t qs, int64_t rows, int64_t width, int64_t hd, const int64_t* pos, const T* cos,
          const T* sin, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + pos[r] * hd;
    const T* s = sin + pos[r] * hd;
    T* row = qk + r * qs;
    const int64_t half = hd / 2;
    for (int64_t h0 = 0; h0 < width; h0 += hd) {
      T* x = row + h0;
      float tmp[512];
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = ld(x, i), b = ld(x, i + half);
        tmp[i] = rnd<T>(a * ld(c, i)) + b * ld(s, i);
        tmp[i + half] = rnd<T>(b * ld(c, i + half)) + a * ld(s, i + half);
      }
      for (int64_t i = 0; i < hd; ++i) st(x, i, tmp[i]);
    }
  }
}
}  // namespace

extern "C" void kvhive_rms_norm(const void* x, int64_t xs, const void* w, void* out, int64_t rows, int64_t h,
                                float eps, int is_bf16, int nt) {
  if (is_bf16) rms_norm((const uint16_t*)x, xs, (const uint16_t*)w, (uint16_t*)out, rows, h, eps, nt);
  else rms_norm((const float*)x, xs, (const float*)w, (float*)out, rows, h, eps, nt);
}

extern "C" void kvhive_silu_mul(const void* gu, int64_t gs, void* out, int64_t rows, int64_t inter, int is_bf16,
                                int nt) {
  if (is_bf16) silu_mul((const uint16_t*)gu, gs, (uint16_t*)out, rows, inter, nt);
  else silu_mul((const float*)gu, gs, (float*)out, rows, inter, nt);
}

// hd_flags: head_dim in the low 16 bits, bit 16 = bfloat16.
extern "C" void kvhive_rope(void* qk, int64_t qs, int64_t rows, int64_t width, const int64_t* pos, const void* cos,
                            const void* sin, int hd_flags, int nt) {
  const int64_t hd = hd_flags & 0xFFFF;
  if (hd > 512) return;
  if (hd_flags >> 16) rope((uint16_t*)qk, qs, rows, width, hd, pos, (const uint16_t*)cos, (const uint16_t*)sin, nt);
  else rope((float*)qk, qs, rows, width, hd, pos, (const float*)cos, (const float*)sin, nt);
}
