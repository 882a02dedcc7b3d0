// 2^x in float32 lanes, ~1e-7 relative: a degree-6 polynomial on the fraction scaled by the
// integer part. Inputs are clamped to [-125, 127], so very negative x gives ~2^-125 (never a
// denormal) and callers mask exact zeros. Needs <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
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
