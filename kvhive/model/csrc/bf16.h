// bfloat16 <-> float32 one value at a time, rounding to nearest even and keeping NaN a NaN,
// as torch does. Needs <cstdint> and <cstring> first.
// Included textually by kvhive.model.native.kernel_source.
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {   // round to nearest even, NaN -> 0x7FC0 (as torch does)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t rounded = uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  return (bits & 0x7FFFFFFF) > 0x7F800000 ? uint16_t(0x7FC0) : rounded;
}
