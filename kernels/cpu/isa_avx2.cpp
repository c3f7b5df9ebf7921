// AVX2 + FMA + F16C instantiation of the kernel (8 fp32 lanes). Compiled with
// -mavx2 -mfma -mf16c; only called after the runtime check in bindings.cpp.
#include "attention.h"
#include "int4.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace tandem {
namespace {

struct Isa : ExpConstants {
  using Vec = __m256;
  static constexpr int kWidth = 8;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  // bf16 is the upper half of an fp32: widen and shift.
  static Vec load(const BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  // 16 bf16 at once, split into the even and the odd elements: one instruction
  // per 8 lanes and no cross-lane shuffle, half the cost of widening in order.
  static Vec load_even(const BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 16));
  }
  static Vec load_odd(const BFloat16* p) {
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                                _mm256_set1_epi32(kHighHalf)));
  }
  static Vec load(const Float16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // 8 INT8 KV codes: sign-extended by the load itself (vpmovsxbd), then converted.
  static Vec load_int8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // 8 bytes of packed INT4 KV codes: their low nibbles and their whole byte values (the high
  // nibble is (byte - low) / 16, which saves the shift).
  static void load_nibbles(const uint8_t* p, Vec* low, Vec* byte) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    *low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xf)));
    *byte = _mm256_cvtepi32_ps(bytes);
  }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  // Stores 16 floats whose even elements are `even` and odd ones `odd` (the
  // inverse of load_even/load_odd's split): interleave within 128-bit lanes, then swap the middle halves.
  static void store_interleaved(float* p, Vec even, Vec odd) {
    const Vec low = _mm256_unpacklo_ps(even, odd);   // elements 0-3 | 8-11
    const Vec high = _mm256_unpackhi_ps(even, odd);  // elements 4-7 | 12-15
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
  // Round to nearest even; NaNs stay NaN (quiet bit forced so rounding cannot make them inf).
  static void store(BFloat16* p, Vec v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    const __m256i shifted = _mm256_srli_epi32(rounded, 16);
    // Pack 8 x 32-bit to 8 x 16-bit (values are < 2^16, so unsigned saturation is exact).
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(shifted),
                                            _mm256_extracti128_si256(shifted, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store(Float16* p, Vec v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(Vec v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

  // e^x: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (about 1 ulp),
  // scaled by 2^n through the exponent bits. Inputs below the fp32 range
  // (including -inf) give exactly 0.
  static Vec exp(Vec x) {
    const Vec underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
    const Vec n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Vec r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    Vec poly = _mm256_set1_ps(kExpC6);
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpC5));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpC4));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpC3));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kExpC2));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.0f));
    const __m256i exponent =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const Vec result = _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
    return _mm256_andnot_ps(underflow, result);
  }
  static float exp_scalar(float x) { return _mm256_cvtss_f32(exp(_mm256_set1_ps(x))); }

 private:
  static constexpr int kHighHalf = static_cast<int>(0xffff0000u);
};


// The INT4 matmul's integer dot product (int4_impl.h): a block's codes widened to int16, 4 rows x
// 4 codes per vector, multiplied in pairs with 4 activations broadcast to every row (vpmaddwd),
// each row's sum in its two lanes until one hadd and one permute per block give 8 rows.
struct Dot {
  static constexpr int kLanes = 8;
  static constexpr int kBatchTile = 4;
  // Per chunk: the low nibbles of this vector's rows 0-3 and 4-7, then the high nibbles.
  static constexpr int kWeightVectors = 4 * kInt4Chunks;
  using WVec = __m256i;
  using IVec = __m256i;
  using FVec = __m256;

  static void unpack_block(const uint8_t* chunks, WVec* w) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + i * kInt4ChunkBytes));
      const __m256i low = _mm256_and_si256(packed, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      w[4 * i] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(low));
      w[4 * i + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(low, 1));
      w[4 * i + 2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(high));
      w[4 * i + 3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(high, 1));
    }
  }
  static IVec block_dot(const WVec* w, const int16_t* x) {
    __m256i rows_0_3 = _mm256_setzero_si256();  // lanes 2r, 2r + 1: row r's two pair sums
    __m256i rows_4_7 = _mm256_setzero_si256();
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m256i x_low = _mm256_set1_epi64x(load_i64(x + 4 * i));
      const __m256i x_high = _mm256_set1_epi64x(load_i64(x + kInt4Block / 2 + 4 * i));
      rows_0_3 = _mm256_add_epi32(rows_0_3, _mm256_madd_epi16(w[4 * i], x_low));
      rows_4_7 = _mm256_add_epi32(rows_4_7, _mm256_madd_epi16(w[4 * i + 1], x_low));
      rows_0_3 = _mm256_add_epi32(rows_0_3, _mm256_madd_epi16(w[4 * i + 2], x_high));
      rows_4_7 = _mm256_add_epi32(rows_4_7, _mm256_madd_epi16(w[4 * i + 3], x_high));
    }
    // hadd within 128-bit lanes gives rows 0, 1, 4, 5 | 2, 3, 6, 7; the permute orders them.
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(rows_0_3, rows_4_7), 0xd8);
  }
  static FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
  static FVec zero() { return _mm256_setzero_ps(); }
  static FVec set1(float value) { return _mm256_set1_ps(value); }
  static FVec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, FVec v) { _mm256_storeu_ps(p, v); }
  static FVec sub(FVec a, FVec b) { return _mm256_sub_ps(a, b); }
  static FVec fma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
};

// The int8-activation matmul's dot products (int4_q8_impl.h): half a chunk's 64 bytes masked to
// their low (or shifted to their high) nibbles are 8 rows x 4 codes, each 32-bit lane one row;
// vpmaddubsw multiplies them with 4 int8 activations broadcast to every lane, its int16 pair sums
// add up over the block's 8 chunk halves (at most 16 x 15 x 127 < 2^15, no saturation), and one
// vpmaddwd widens them.
struct Q8Dot : Dot {
  static constexpr int kRowTile = 4;

  static IVec set1_int(int32_t value) { return _mm256_set1_epi32(value); }
  template <int kRows>
  static void block_dots(const uint8_t* chunks, const int8_t* x, size_t row_stride, IVec* sums) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i pair_sums[kRows];
    for (int r = 0; r < kRows; ++r) pair_sums[r] = _mm256_setzero_si256();
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + i * kInt4ChunkBytes));
      const __m256i low = _mm256_and_si256(packed, mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = x + r * row_stride;
        const __m256i x_low = _mm256_set1_epi32(load_i32(row + 4 * i));
        const __m256i x_high = _mm256_set1_epi32(load_i32(row + kInt4Block / 2 + 4 * i));
        pair_sums[r] = _mm256_add_epi16(pair_sums[r], _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low),
                                                                        _mm256_maddubs_epi16(high, x_high)));
      }
    }
    for (int r = 0; r < kRows; ++r) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pair_sums[r], _mm256_set1_epi16(1)));
  }
};

}  // namespace
}  // namespace tandem

#include "attention_impl.h"
#include "int4_impl.h"
#include "int4_q8_impl.h"
#include "rms_norm_impl.h"
#include "rope_impl.h"
#include "gemv_impl.h"
#include "elementwise_impl.h"

namespace tandem {
const KernelTable* avx2_kernels() {
  static const KernelTable table{"avx2", attend_units, finish_segment, merge_partials, int4_tiles, int4_quantize_rows,
                                 int4_q8_tiles, int4_q8_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert, kIntegerDots};
  return &table;
}
}  // namespace tandem

#else

namespace tandem {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace tandem

#endif
