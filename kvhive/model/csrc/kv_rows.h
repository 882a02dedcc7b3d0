// The KV pool's row types, and rows of any of them as float32 one at a time (scalar code).
// float and uint16_t (bfloat16) rows hold head_dim values; I8 and F8 rows are packed 8-bit rows
// (kvhive.model.kv_quant): head_dim codes, int8 or OCP float8 E4M3, then a bfloat16 scale, with
// value = decode(code) * scale, exact in float32. A packed row is head_dim + 2 bytes, so rows are
// aligned to nothing. Needs <cmath>, <cstdint>, <cstring>, <type_traits>, bf16.h and (for the
// vector levels' KVHIVE_* macros) <immintrin.h> first.
// Included textually by kvhive.model.native.kernel_source.
struct I8 { int8_t code; };   // a byte of an int8-coded row
struct F8 { uint8_t code; };  // a byte of an E4M3-coded row

template <typename K>
constexpr bool kPacked = sizeof(K) == 1;

// Elements of a row (a packed row's scale is two elements).
template <typename K>
constexpr int64_t row_len(int64_t head_dim) { return kPacked<K> ? head_dim + 2 : head_dim; }

// The vector paths read an E4M3 code as its value times 2^-8 (its float16 bits, below); they fold
// this factor back in once per score and once per output.
template <typename K>
constexpr float kCodeUnit = std::is_same<K, F8>::value ? 256.f : 1.f;

// The bfloat16 scale of a packed row of head_dim codes, read unaligned.
template <typename K>
inline float row_scale(const K* row, int64_t head_dim) {
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const char*>(row) + head_dim, 2);
  return bf16_to_float(bits);
}

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void to_float(const uint16_t* src, float* dst, int64_t n) {  // bfloat16: the top half of a float
  uint32_t bits[256];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bits[i] = uint32_t(src[i]) << 16;
  std::memcpy(dst, bits, n * 4);
}
inline void to_float(const I8* src, float* dst, int64_t n) {      // n codes, then the scale
  const float scale = row_scale(src, n);
  const int8_t* code = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = float(code[i]) * scale;
}
// E4M3 by bit arithmetic (vectorised, unlike a table): a normal code's magnitude bits shifted into
// float32's place with the exponent rebiased (7 -> 127), a subnormal's mantissa times 2^-9. With
// F16C, 8 codes at a time through their float16 bits (the vector paths' conversion, decode.cpp).
inline void to_float(const F8* src, float* dst, int64_t n) {
  const float scale = row_scale(src, n);
  const uint8_t* code = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__F16C__) && (defined(KVHIVE_AVX512) || defined(KVHIVE_AVX2))
  const __m128i bits = _mm_set1_epi16(int16_t(0xBF80));
  const __m256 unit = _mm256_set1_ps(256.f), scales = _mm256_set1_ps(scale);   // 256 first: exact
  for (; i + 8 <= n; i += 8) {
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + i)));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), bits)), unit);
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, scales));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) {
    const uint32_t magnitude = code[j] & 0x7Fu, bits = (magnitude << 20) + (120u << 23);
    float normal;
    std::memcpy(&normal, &bits, 4);
    const float x = magnitude < 8 ? float(magnitude) * 0x1p-9f : normal;
    dst[j] = (code[j] & 0x80 ? -x : x) * scale;
  }
}
