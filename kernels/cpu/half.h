// fp16 <-> fp32 in plain C++ (round to nearest even), for the scalar path and the fused
// append's quantization, which must round scales exactly as torch's .half() does.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {
namespace {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));  // inf, NaN
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));  // rebias 15 -> 127
}

inline uint16_t float_to_half(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffff;
  if (x >= 0x7f800000) return sign | 0x7c00 | (x > 0x7f800000 ? 0x200 : 0);  // inf, NaN
  if (x >= 0x477ff000) return sign | 0x7c00;  // rounds past 65504: overflow to inf
  if (x < 0x38800000) {  // below 2^-14: a subnormal half, in units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.0f));
  }
  const uint32_t rounded = x + 0xfff + ((x >> 13) & 1);  // nearest even at bit 13
  return sign | static_cast<uint16_t>((rounded - 0x38000000) >> 13);
}

}  // namespace
}  // namespace tandem
