// 2^x in 8 float32 lanes with AVX2 + FMA, ~2e-7 relative: a degree-5 polynomial (fitted for least
// maximum relative error, 9e-8 in exact arithmetic) on the fraction f = x - round(x) in [-0.5, 0.5],
// times 2^round(x) added straight into its exponent field.
// Inputs are clamped to [-125, 127], so the exponent stays a normal one (very negative x gives
// ~2^-125, never a denormal or zero: callers mask exact zeros). Needs <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
inline __m256 exp2_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-125.f)), _mm256_set1_ps(127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3264727e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6715127e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5507337e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022242e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314698e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // p is in [0.70, 1.42]: adding n to its exponent field keeps it a normal float for n in [-125, 127].
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
