// The horizontal sums of n <= 8 vectors as one vector (lane i = sum of v[i], 0 past n), by a
// transpose-add tree: 21 instructions for 8 sums. Used by the AVX2 quantised matmul and decode
// attention kernels. Needs <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
inline __m256 sum8(const __m256* v, int n) {
  __m256 x[8], a[4];
  for (int i = 0; i < 8; ++i) x[i] = i < n ? v[i] : _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i)          // a[i] = [x[i] low + high half | x[i + 4] low + high half]
    a[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[i], x[i + 4], 0x20), _mm256_permute2f128_ps(x[i], x[i + 4], 0x31));
  // per 128-bit half: [a0 0+2, a1 0+2, a0 1+3, a1 1+3], then the same for a2, a3
  const __m256 b0 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 b1 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  return _mm256_add_ps(_mm256_shuffle_ps(b0, b1, 0x44), _mm256_shuffle_ps(b0, b1, 0xEE));
}
