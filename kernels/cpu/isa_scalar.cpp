// Portable instantiation of the kernel (one lane, plain C++): the fallback on
// CPUs without a vector path, and the baseline the tests compare paths against.
#include <cmath>
#include <cstring>

#include "attention.h"

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

float half_to_float(uint16_t h) {
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

uint16_t float_to_half(float f) {
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

struct Isa {
  using Vec = float;
  static constexpr int kWidth = 1;

  static Vec zero() { return 0.0f; }
  static Vec set1(float x) { return x; }
  static Vec load(const float* p) { return *p; }
  static Vec load(const BFloat16* p) { return bits_to_float(static_cast<uint32_t>(p->bits) << 16); }
  static Vec load(const Float16* p) { return half_to_float(p->bits); }
  static void store(float* p, Vec v) { *p = v; }
  static void store(BFloat16* p, Vec v) {
    const uint32_t bits = float_to_bits(v);
    if (std::isnan(v)) {
      p->bits = static_cast<uint16_t>((bits | 0x400000) >> 16);
      return;
    }
    p->bits = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
  static void store(Float16* p, Vec v) { p->bits = float_to_half(v); }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec sub(Vec a, Vec b) { return a - b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static Vec div(Vec a, Vec b) { return a / b; }
  static Vec max(Vec a, Vec b) { return a > b ? a : b; }
  static Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
  static float reduce_add(Vec v) { return v; }
  static float reduce_max(Vec v) { return v; }
  static Vec exp(Vec x) { return std::exp(x); }
  static float exp_scalar(float x) { return std::exp(x); }
};

}  // namespace
}  // namespace tandem

#include "attention_impl.h"
#include "int4_portable.h"
#include "int4_impl.h"
#include "rms_norm_impl.h"
#include "rope_impl.h"
#include "gemv_impl.h"
#include "elementwise_impl.h"

namespace tandem {
const KernelTable* scalar_kernels() {
  static const KernelTable table{"scalar", attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert};
  return &table;
}
}  // namespace tandem
