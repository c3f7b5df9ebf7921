// Portable instantiation of the kernel (one lane, plain C++): the fallback on
// CPUs without a vector path, and the baseline the tests compare paths against.
#include <cmath>

#include "attention.h"
#include "half.h"

namespace tandem {
namespace {

struct Isa {
  using Vec = float;
  static constexpr int kWidth = 1;

  static Vec zero() { return 0.0f; }
  static Vec set1(float x) { return x; }
  static Vec load(const float* p) { return *p; }
  static Vec load(const BFloat16* p) { return bits_to_float(static_cast<uint32_t>(p->bits) << 16); }
  static Vec load(const Float16* p) { return half_to_float(p->bits); }
  static Vec load_int8(const int8_t* p) { return static_cast<float>(*p); }
  // One byte of packed INT4 KV codes: its low nibble and its whole value (high = (byte - low) / 16).
  static void load_nibbles(const uint8_t* p, Vec* low, Vec* byte) {
    *low = static_cast<float>(*p & 0xf);
    *byte = static_cast<float>(*p);
  }
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
#include "int4_q8_portable.h"
#include "int4_impl.h"
#include "int4_q8_impl.h"
#include "rms_norm_impl.h"
#include "rope_impl.h"
#include "gemv_impl.h"
#include "elementwise_impl.h"

namespace tandem {
const KernelTable* scalar_kernels() {
  static const KernelTable table{"scalar", attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_q8_tiles, int4_q8_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert, kIntegerDots};
  return &table;
}
}  // namespace tandem
