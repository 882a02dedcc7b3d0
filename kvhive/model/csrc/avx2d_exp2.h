// 2^x in float32 lanes (AVX2 + FMA), ~1e-7 relative: a degree-6 polynomial on the fraction scaled
// by the integer part. Inputs are clamped to [-125, 127], so very negative x gives ~2^-125 (never a
// denormal) and callers mask exact zeros. Needs <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-125.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.540353e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.333355e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550411e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // 2^n as a float's exponent field: n + 127 lies in [2, 254]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
