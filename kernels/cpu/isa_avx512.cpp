// AVX-512 instantiation of the kernel (16 fp32 lanes). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c; only called
// after the runtime check in bindings.cpp.
#include "attention.h"

// isa_avx512_vnni.cpp compiles this file again with VNNI, under its own name.
#ifndef TANDEM_AVX512_TABLE
#define TANDEM_AVX512_NAME "avx512"
#define TANDEM_AVX512_TABLE avx512_kernels
#endif
#include "int4.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace tandem {
namespace {

struct Isa : ExpConstants {
  using Vec = __m512;
  static constexpr int kWidth = 16;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  // bf16 is the upper half of an fp32: widen and shift.
  static Vec load(const BFloat16* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  // 32 bf16 at once, split into the even and the odd elements: one instruction
  // per 16 lanes and no cross-lane shuffle, half the cost of widening in order.
  static Vec load_even(const BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
  }
  static Vec load_odd(const BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32(kHighHalf)));
  }
  static Vec load(const Float16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  // Round to nearest even; NaNs stay NaN (quiet bit forced so rounding cannot make them inf).
  static void store(BFloat16* p, Vec v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    const __m256i out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
  }
  static void store(Float16* p, Vec v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }

  // e^x: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (about 1 ulp),
  // scaled by 2^n. Inputs below the fp32 range (including -inf) give exactly 0.
  static Vec exp(Vec x) {
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
    const Vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Vec r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    Vec poly = _mm512_set1_ps(kExpC6);
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpC5));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpC4));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpC3));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpC2));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(poly, n));
  }
  static float exp_scalar(float x) { return _mm512_cvtss_f32(exp(_mm512_set1_ps(x))); }

 private:
  static constexpr int kHighHalf = static_cast<int>(0xffff0000u);
};


// The INT4 matmul's int8 dot product (int4_impl.h): 16 output rows per vector, their 4-byte
// groups of codes multiplied by 4 activations broadcast to every lane. With VNNI (the
// avx512_vnni build of this file) one vpdpbusd per 4 codes; without, pairs summed to int16 by
// vpmaddubsw (at most 8 x 2 x 15 x 127 = 30480: no overflow) and widened once per block.
struct Dot8 {
  static constexpr int kLanes = 16;
  static constexpr int kBatchTile = 8;
  using WVec = __m512i;
  using IVec = __m512i;
  using FVec = __m512;

  static void unpack_block(const uint8_t* chunks, WVec* w) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m512i packed = _mm512_loadu_si512(chunks + i * kInt4ChunkBytes);
      w[i] = _mm512_and_si512(packed, mask);
      w[kInt4Chunks + i] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
    }
  }
  static IVec block_dot(const WVec* w, const int8_t* x) {
#ifdef __AVX512VNNI__
    __m512i sums = _mm512_setzero_si512();
    for (int c = 0; c < 2 * kInt4Chunks; ++c) sums = _mm512_dpbusd_epi32(sums, w[c], _mm512_set1_epi32(load_i32(x + 4 * c)));
    return sums;
#else
    __m512i pairs = _mm512_maddubs_epi16(w[0], _mm512_set1_epi32(load_i32(x)));
    for (int c = 1; c < 2 * kInt4Chunks; ++c) {
      pairs = _mm512_add_epi16(pairs, _mm512_maddubs_epi16(w[c], _mm512_set1_epi32(load_i32(x + 4 * c))));
    }
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#endif
  }
  static FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
  static FVec zero() { return _mm512_setzero_ps(); }
  static FVec set1(float value) { return _mm512_set1_ps(value); }
  static FVec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, FVec v) { _mm512_storeu_ps(p, v); }
  static FVec sub(FVec a, FVec b) { return _mm512_sub_ps(a, b); }
  static FVec fma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace
}  // namespace tandem

#include "attention_impl.h"
#include "int4_impl.h"

namespace tandem {
const KernelTable* TANDEM_AVX512_TABLE() {
  static const KernelTable table{TANDEM_AVX512_NAME, attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_dequantize};
  return &table;
}
}  // namespace tandem

#else

namespace tandem {
const KernelTable* TANDEM_AVX512_TABLE() { return nullptr; }
}  // namespace tandem

#endif
