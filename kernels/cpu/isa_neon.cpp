// AArch64 NEON instantiation of the kernel (4 fp32 lanes). NEON is part of the
// AArch64 baseline, so no runtime check is needed where this compiles.
#include "attention.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>

#include <cstring>

namespace tandem {
namespace {

struct Isa : ExpConstants {
  using Vec = float32x4_t;
  static constexpr int kWidth = 4;

  static Vec zero() { return vdupq_n_f32(0.0f); }
  static Vec set1(float x) { return vdupq_n_f32(x); }
  static Vec load(const float* p) { return vld1q_f32(p); }
  // bf16 is the upper half of an fp32: widen with a shift.
  static Vec load(const BFloat16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static Vec load(const Float16* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }
  // 4 INT8 KV codes: one 32-bit load, widened 8 -> 16 -> 32 bits, converted.
  static Vec load_int8(const int8_t* p) {
    int32_t word;
    std::memcpy(&word, p, sizeof(word));
    const int8x8_t bytes = vreinterpret_s8_s32(vdup_n_s32(word));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(bytes))));
  }
  // 4 bytes of packed INT4 KV codes: their low nibbles and their whole byte values (the high
  // nibble is (byte - low) / 16).
  static void load_nibbles(const uint8_t* p, Vec* low, Vec* byte) {
    uint32_t word;
    std::memcpy(&word, p, sizeof(word));
    const uint8x8_t bytes = vreinterpret_u8_u32(vdup_n_u32(word));
    const uint32x4_t wide = vmovl_u16(vget_low_u16(vmovl_u8(bytes)));
    *low = vcvtq_f32_u32(vandq_u32(wide, vdupq_n_u32(0xf)));
    *byte = vcvtq_f32_u32(wide);
  }
  static void store(float* p, Vec v) { vst1q_f32(p, v); }
  // Round to nearest even; NaNs stay NaN (quiet bit forced so rounding cannot make them inf).
  static void store(BFloat16* p, Vec v) {
    const uint32x4_t bits = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7fff), lsb));
    const uint32x4_t not_nan = vceqq_f32(v, v);
    const uint32x4_t chosen = vbslq_u32(not_nan, rounded, vorrq_u32(bits, vdupq_n_u32(0x400000)));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vshrn_n_u32(chosen, 16));
  }
  static void store(Float16* p, Vec v) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(v)));
  }
  static Vec add(Vec a, Vec b) { return vaddq_f32(a, b); }
  static Vec sub(Vec a, Vec b) { return vsubq_f32(a, b); }
  static Vec mul(Vec a, Vec b) { return vmulq_f32(a, b); }
  static Vec div(Vec a, Vec b) { return vdivq_f32(a, b); }
  static Vec max(Vec a, Vec b) { return vmaxq_f32(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
  static float reduce_add(Vec v) { return vaddvq_f32(v); }
  static float reduce_max(Vec v) { return vmaxvq_f32(v); }

  // e^x as in the x86 paths: range reduction, degree-6 polynomial, 2^n via the
  // exponent bits; inputs below the fp32 range (including -inf) give exactly 0.
  static Vec exp(Vec x) {
    const uint32x4_t underflow = vcltq_f32(x, vdupq_n_f32(kExpMin));
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kExpMin)), vdupq_n_f32(kExpMax));
    const Vec n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
    Vec r = vfmsq_f32(x, n, vdupq_n_f32(kLn2Hi));
    r = vfmsq_f32(r, n, vdupq_n_f32(kLn2Lo));
    Vec poly = vdupq_n_f32(kExpC6);
    poly = vfmaq_f32(vdupq_n_f32(kExpC5), poly, r);
    poly = vfmaq_f32(vdupq_n_f32(kExpC4), poly, r);
    poly = vfmaq_f32(vdupq_n_f32(kExpC3), poly, r);
    poly = vfmaq_f32(vdupq_n_f32(kExpC2), poly, r);
    poly = vfmaq_f32(vdupq_n_f32(1.0f), poly, r);
    poly = vfmaq_f32(vdupq_n_f32(1.0f), poly, r);
    const int32x4_t exponent = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const Vec result = vmulq_f32(poly, vreinterpretq_f32_s32(exponent));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(result), underflow));
  }
  static float exp_scalar(float x) { return vgetq_lane_f32(exp(vdupq_n_f32(x)), 0); }
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
const KernelTable* neon_kernels() {
  static const KernelTable table{"neon", attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert};
  return &table;
}
}  // namespace tandem

#else

namespace tandem {
const KernelTable* neon_kernels() { return nullptr; }
}  // namespace tandem

#endif
