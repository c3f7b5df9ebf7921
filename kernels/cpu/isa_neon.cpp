// AArch64 NEON instantiation of the kernel (4 fp32 lanes). NEON is part of the
// AArch64 baseline, so no runtime check is needed where this compiles.
#include "attention.h"

// isa_neon_dotprod.cpp compiles this file again with the dot product extension, under its own name.
#ifndef TANDEM_NEON_TABLE
#define TANDEM_NEON_NAME "neon"
#define TANDEM_NEON_TABLE neon_kernels
#endif

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

// The int8-activation matmul's dot products (int4_q8_impl.h): a quarter of a chunk's 64 bytes
// masked to their low (or shifted to their high) nibbles is 4 rows x 4 codes, each 32-bit lane one
// row, and 4 int8 activations broadcast to every lane meet them in sdot (armv8.2-a dotprod).
// Without it, widening multiplies add up 8 products per int16 lane (at most 8 x 15 x 127 < 2^15)
// before two pairwise adds leave one row per lane.
struct Q8Dot {
  static constexpr int kLanes = 4;
  static constexpr int kRowTile = 8;
  using IVec = int32x4_t;
  using FVec = float32x4_t;

  static IVec set1_int(int32_t value) { return vdupq_n_s32(value); }
  template <int kRows>
  static void block_dots(const uint8_t* chunks, const int8_t* x, size_t row_stride, IVec* sums) {
#ifndef __ARM_FEATURE_DOTPROD
    int16x8_t rows_01[kRows];  // lanes 4r' + j: row r' (0, 1) times activation j
    int16x8_t rows_23[kRows];
    for (int r = 0; r < kRows; ++r) rows_01[r] = rows_23[r] = vdupq_n_s16(0);
#endif
    for (int i = 0; i < kInt4Chunks; ++i) {
      const uint8x16_t packed = vld1q_u8(chunks + i * kInt4ChunkBytes);
      const int8x16_t low = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0f)));
      const int8x16_t high = vreinterpretq_s8_u8(vshrq_n_u8(packed, 4));
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = x + r * row_stride;
        const int8x16_t x_low = vreinterpretq_s8_s32(vdupq_n_s32(load_i32(row + 4 * i)));
        const int8x16_t x_high = vreinterpretq_s8_s32(vdupq_n_s32(load_i32(row + kInt4Block / 2 + 4 * i)));
#ifdef __ARM_FEATURE_DOTPROD
        sums[r] = vdotq_s32(vdotq_s32(sums[r], low, x_low), high, x_high);
#else
        rows_01[r] = vmlal_s8(vmlal_s8(rows_01[r], vget_low_s8(low), vget_low_s8(x_low)), vget_low_s8(high),
                              vget_low_s8(x_high));
        rows_23[r] = vmlal_high_s8(vmlal_high_s8(rows_23[r], low, x_low), high, x_high);
#endif
      }
    }
#ifndef __ARM_FEATURE_DOTPROD
    for (int r = 0; r < kRows; ++r) {
      sums[r] = vaddq_s32(sums[r], vpaddq_s32(vpaddlq_s16(rows_01[r]), vpaddlq_s16(rows_23[r])));
    }
#endif
  }
  static FVec to_float(IVec v) { return vcvtq_f32_s32(v); }
  static FVec zero() { return vdupq_n_f32(0.0f); }
  static FVec set1(float value) { return vdupq_n_f32(value); }
  static FVec load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, FVec v) { vst1q_f32(p, v); }
  static FVec fma(FVec a, FVec b, FVec c) { return vfmaq_f32(c, a, b); }
};

}  // namespace
}  // namespace tandem

#include "attention_impl.h"
#include "int4_portable.h"
#include "int4_impl.h"
#include "int4_q8_impl.h"
#include "rms_norm_impl.h"
#include "rope_impl.h"
#include "gemv_impl.h"
#include "elementwise_impl.h"

namespace tandem {
const KernelTable* TANDEM_NEON_TABLE() {
  static const KernelTable table{TANDEM_NEON_NAME, attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_q8_tiles, int4_q8_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert, kIntegerDots};
  return &table;
}
}  // namespace tandem

#else

namespace tandem {
const KernelTable* TANDEM_NEON_TABLE() { return nullptr; }
}  // namespace tandem

#endif
