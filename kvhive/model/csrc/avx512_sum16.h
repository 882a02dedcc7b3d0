// The horizontal sums of n <= 16 vectors as one vector (lane i = sum of v[i], 0 past n), by a
// transpose-add tree: 45 instructions for 16 sums instead of ~8 for each. Used by the quantised
// matmul and the decode attention kernels. Needs <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
inline __m512 sum16(const __m512* v, int n) {
  __m512 x[16], s[8], t[4];
  for (int i = 0; i < 16; ++i) {       // fed transposed (the tree returns v0 v4 v8 v12 v1 ...)
    const int src = (i % 4) * 4 + i / 4;
    x[i] = src < n ? v[src] : _mm512_setzero_ps();
  }
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
}
