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

#ifdef __AVX512VNNI__
// Attention on quantized KV by vpdpbusd (attention_quant_impl.h: score_dotted_span,
// value_dotted_group), each 32-bit lane the dot product of 4 unsigned with 4 signed bytes.
struct VnniDots {
  using IVec = __m512i;
  static IVec zero() { return _mm512_setzero_si512(); }
  static IVec set1(int32_t x) { return _mm512_set1_epi32(x); }
  static IVec add(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
  static __m512 to_float(IVec v) { return _mm512_cvtepi32_ps(v); }

  // Keys: 4 code rows of 16 tokens (row r at rows + r * row_bytes) as 16 lanes of one token's 4
  // codes. vpermd puts each token quarter's 4 bytes of every row in one 128-bit lane, vpshufb
  // transposes the 4 x 4 bytes there.
  static IVec load_key_quad(const uint8_t* rows, size_t row_bytes) {
    __m512i quad;
    if (row_bytes == 16) {  // a block of 16 tokens: the 4 rows are adjacent
      quad = _mm512_loadu_si512(rows);
    } else {
      quad = _mm512_castsi128_si512(load_16(rows));
      quad = _mm512_inserti32x4(quad, load_16(rows + row_bytes), 1);
      quad = _mm512_inserti32x4(quad, load_16(rows + 2 * row_bytes), 2);
      quad = _mm512_inserti32x4(quad, load_16(rows + 3 * row_bytes), 3);
    }
    const __m512i quarters = _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), quad);
    const __m128i transpose = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_shuffle_epi8(quarters, _mm512_broadcast_i32x4(transpose));
  }
  static IVec flip_sign(IVec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
  static IVec low_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
  static IVec high_nibbles(IVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
  // acc + per lane the dot product of its 4 u8 codes with the 4 int8 codes at q.
  static IVec dot(IVec acc, IVec codes, const int8_t* q) {
    return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(load_i32(q)));
  }

  // Values: 4 tokens' rows of one group's 64 channels (INT8 codes, or INT4 bytes split into their
  // low nibbles, channels 0-31, and high ones, 32-63) interleaved so that vector k's lane (L, i)
  // holds channel 16 L + 4 k + i of the 4 tokens ("quad order").
  static void load_int8_values(const uint8_t* row, size_t row_bytes, IVec* v) {
    interleave(_mm512_loadu_si512(row), _mm512_loadu_si512(row + row_bytes), _mm512_loadu_si512(row + 2 * row_bytes),
               _mm512_loadu_si512(row + 3 * row_bytes), v);
  }
  // INT4: tokens 0 and 2 (then 1 and 3) share a register, one per 256-bit half, so the two byte
  // interleaves run once over all four; each 32-bit lane then holds one byte column j of the 4
  // tokens, whose low nibbles are channel j and high nibbles channel j + 32, regrouped in quad order.
  static void load_int4_values(const uint8_t* row, size_t row_bytes, IVec* v) {
    const __m512i even = with_upper(load_32(row), load_32(row + 2 * row_bytes));   // tokens 0 | 2
    const __m512i odd = with_upper(load_32(row + row_bytes), load_32(row + 3 * row_bytes));  // 1 | 3
    const __m512i low = _mm512_unpacklo_epi8(even, odd), high = _mm512_unpackhi_epi8(even, odd);
    // Lanes by byte column: j 0-7, 16-23, 8-15, 24-31; `first` tokens 0 and 1, `second` 2 and 3.
    const __m512i first = _mm512_shuffle_i64x2(low, high, 0x44), second = _mm512_shuffle_i64x2(low, high, 0xee);
    const __m512i columns[2] = {_mm512_unpacklo_epi16(first, second), _mm512_unpackhi_epi16(first, second)};
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int c = 0; c < 2; ++c) {  // columns[c]'s lanes: j 4c.. of 0, 16, 8 and 24
      const __m512i channels = _mm512_and_si512(columns[c], mask);                         // channel j
      const __m512i upper = _mm512_and_si512(_mm512_srli_epi16(columns[c], 4), mask);     // j + 32
      v[c] = _mm512_shuffle_i64x2(channels, upper, 0x44);
      v[c + 2] = _mm512_shuffle_i64x2(channels, upper, 0xee);
    }
  }
  // acc + per lane its 4 tokens' codes times their 4 u8 coefficients at c.
  static IVec dot_values(IVec acc, IVec values, const uint8_t* c) {
    return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(load_i32(reinterpret_cast<const int8_t*>(c))), values);
  }
  // Probabilities times scales (fp32, 16 tokens) rounded to u8 codes with `inverse` = 255 / max.
  static void store_coefficients(uint8_t* codes, __m512 coefficients, __m512 inverse) {
    const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(coefficients, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtusepi32_epi8(rounded));
  }
  // The query group q [64] rotated in place (kv_quant.h: hadamard_rotate's butterflies, the same
  // adds in the same order, so the same bits), then as int8 codes with their step and sum.
  static void quantize_query_group(float* q, int8_t* codes, float* step, int32_t* code_sum) {
    __m512 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(q + 16 * i);
    for (int span = 1; span < 16; span *= 2) {  // partners within a vector: lane l and l ^ span
      const __m512i partner = _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(span));
      const __mmask16 upper = static_cast<__mmask16>(upper_lanes(span));
      for (int i = 0; i < 4; ++i) {
        const __m512 other = _mm512_permutexvar_ps(partner, v[i]);
        v[i] = _mm512_mask_blend_ps(upper, _mm512_add_ps(v[i], other), _mm512_sub_ps(other, v[i]));
      }
    }
    for (int span = 1; span < 4; span *= 2) {  // spans 16 and 32: whole vectors
      for (int i = 0; i < 4; ++i) {
        if (i & span) continue;
        const __m512 low = v[i], high = v[i + span];
        v[i] = _mm512_add_ps(low, high);
        v[i + span] = _mm512_sub_ps(low, high);
      }
    }
    __m512 absmax = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm512_mul_ps(v[i], _mm512_set1_ps(kHadamardNorm));
      absmax = _mm512_max_ps(absmax, _mm512_abs_ps(v[i]));
    }
    *step = _mm512_reduce_max_ps(absmax) / kInt8MaxCode;
    const __m512 inverse = _mm512_set1_ps(*step > 0.0f ? 1.0f / *step : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inverse));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16 * i), _mm512_cvtsepi32_epi8(rounded));
      sum = _mm512_add_epi32(sum, rounded);
    }
    *code_sum = _mm512_reduce_add_epi32(sum);
  }
  // A group's 64 floats from quad order to channel order: a 4 x 4 transpose of 128-bit lanes.
  static void to_channel_order(float* group) {
    const __m512 w0 = _mm512_loadu_ps(group), w1 = _mm512_loadu_ps(group + 16);
    const __m512 w2 = _mm512_loadu_ps(group + 32), w3 = _mm512_loadu_ps(group + 48);
    const __m512 t0 = _mm512_shuffle_f32x4(w0, w1, 0x44), t1 = _mm512_shuffle_f32x4(w0, w1, 0xee);
    const __m512 t2 = _mm512_shuffle_f32x4(w2, w3, 0x44), t3 = _mm512_shuffle_f32x4(w2, w3, 0xee);
    _mm512_storeu_ps(group, _mm512_shuffle_f32x4(t0, t2, 0x88));
    _mm512_storeu_ps(group + 16, _mm512_shuffle_f32x4(t0, t2, 0xdd));
    _mm512_storeu_ps(group + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
    _mm512_storeu_ps(group + 48, _mm512_shuffle_f32x4(t1, t3, 0xdd));
  }

 private:
  static __m128i load_16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  // Lanes whose index has bit `span` set: the second of each butterfly pair.
  static int upper_lanes(int span) {
    int mask = 0;
    for (int lane = 0; lane < 16; ++lane) mask |= (lane & span) ? 1 << lane : 0;
    return mask;
  }
  static __m256i load_32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static __m512i with_upper(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  // Rows r0..r3 (64 channels each) to quad order: bytes, then byte pairs, interleaved per 128-bit lane.
  static void interleave(__m512i r0, __m512i r1, __m512i r2, __m512i r3, IVec* v) {
    const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
    const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
    v[0] = _mm512_unpacklo_epi16(a, c);
    v[1] = _mm512_unpackhi_epi16(a, c);
    v[2] = _mm512_unpacklo_epi16(b, d);
    v[3] = _mm512_unpackhi_epi16(b, d);
  }
};
#endif

struct Isa : ExpConstants {
  using Vec = __m512;
  static constexpr int kWidth = 16;
#ifdef __AVX512VNNI__
  using Dots = VnniDots;
#endif

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
  // 16 INT8 KV codes: sign-extended by the load itself (vpmovsxbd), then converted.
  static Vec load_int8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 bytes of packed INT4 KV codes: their low nibbles and their whole byte values (the high
  // nibble is (byte - low) / 16). vpermps reads only an index's low 4 bits, so the nibble is a
  // lookup in a 0..15 table with no mask and no conversion.
  static void load_nibbles(const uint8_t* p, Vec* low, Vec* byte) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const Vec nibbles = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *low = _mm512_permutexvar_ps(bytes, nibbles);
    *byte = _mm512_cvtepi32_ps(bytes);
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
  static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
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


// The INT4 matmul's integer dot product (int4_impl.h): a block's codes widened to int16, 8 rows x
// 4 codes per vector, multiplied in pairs with 4 activations broadcast to every row (VNNI, the
// avx512_vnni build of this file: vpdpwssd; else vpmaddwd and an add), each row's sum in its two
// lanes until one permute per block pairs them up into 16 rows.
struct Dot {
  static constexpr int kLanes = 16;
  static constexpr int kBatchTile = 8;
  // Per chunk: the low nibbles of rows 0-7 and 8-15, then the high nibbles of rows 0-7 and 8-15.
  static constexpr int kWeightVectors = 4 * kInt4Chunks;
  using WVec = __m512i;
  using IVec = __m512i;
  using FVec = __m512;

  static void unpack_block(const uint8_t* chunks, WVec* w) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m512i packed = _mm512_loadu_si512(chunks + i * kInt4ChunkBytes);
      const __m512i low = _mm512_and_si512(packed, mask);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
      w[4 * i] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(low));
      w[4 * i + 1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(low, 1));
      w[4 * i + 2] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(high));
      w[4 * i + 3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(high, 1));
    }
  }
  static IVec block_dot(const WVec* w, const int16_t* x) {
    __m512i rows_0_7 = _mm512_setzero_si512();  // lanes 2r, 2r + 1: row r's two pair sums
    __m512i rows_8_15 = _mm512_setzero_si512();
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m512i x_low = _mm512_set1_epi64(load_i64(x + 4 * i));
      const __m512i x_high = _mm512_set1_epi64(load_i64(x + kInt4Block / 2 + 4 * i));
      rows_0_7 = dot_pairs(rows_0_7, w[4 * i], x_low);
      rows_8_15 = dot_pairs(rows_8_15, w[4 * i + 1], x_low);
      rows_0_7 = dot_pairs(rows_0_7, w[4 * i + 2], x_high);
      rows_8_15 = dot_pairs(rows_8_15, w[4 * i + 3], x_high);
    }
    alignas(64) static constexpr int32_t kEven[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    alignas(64) static constexpr int32_t kOdd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i even = _mm512_permutex2var_epi32(rows_0_7, _mm512_load_si512(kEven), rows_8_15);
    const __m512i odd = _mm512_permutex2var_epi32(rows_0_7, _mm512_load_si512(kOdd), rows_8_15);
    return _mm512_add_epi32(even, odd);
  }
  static __m512i dot_pairs(__m512i sums, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(sums, a, b);
#else
    return _mm512_add_epi32(sums, _mm512_madd_epi16(a, b));
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

// The int8-activation matmul's dot products (int4_q8_impl.h): a chunk's 64 bytes masked to their
// low (or shifted to their high) nibbles are 16 rows x 4 codes, each 32-bit lane one row; 4 int8
// activations broadcast to every lane meet them in vpdpbusd (u8 x s8, 4 products per lane). Without
// VNNI, vpmaddubsw's int16 pair sums add up over the block's 8 chunk halves (at most
// 16 x 15 x 127 < 2^15, no saturation) before one vpmaddwd widens them.
struct Q8Dot : Dot {
  static constexpr int kRowTile = 8;

  static IVec set1_int(int32_t value) { return _mm512_set1_epi32(value); }
  template <int kRows>
  static void block_dots(const uint8_t* chunks, const int8_t* x, size_t row_stride, IVec* sums) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
#ifndef __AVX512VNNI__
    __m512i pair_sums[kRows];
    for (int r = 0; r < kRows; ++r) pair_sums[r] = _mm512_setzero_si512();
#endif
    for (int i = 0; i < kInt4Chunks; ++i) {
      const __m512i packed = _mm512_loadu_si512(chunks + i * kInt4ChunkBytes);
      const __m512i low = _mm512_and_si512(packed, mask);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* row = x + r * row_stride;
        const __m512i x_low = _mm512_set1_epi32(load_i32(row + 4 * i));
        const __m512i x_high = _mm512_set1_epi32(load_i32(row + kInt4Block / 2 + 4 * i));
#ifdef __AVX512VNNI__
        sums[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[r], low, x_low), high, x_high);
#else
        pair_sums[r] = _mm512_add_epi16(pair_sums[r], _mm512_add_epi16(_mm512_maddubs_epi16(low, x_low),
                                                                        _mm512_maddubs_epi16(high, x_high)));
#endif
      }
    }
#ifndef __AVX512VNNI__
    for (int r = 0; r < kRows; ++r) sums[r] = _mm512_add_epi32(sums[r], _mm512_madd_epi16(pair_sums[r], _mm512_set1_epi16(1)));
#endif
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
const KernelTable* TANDEM_AVX512_TABLE() {
  static const KernelTable table{TANDEM_AVX512_NAME, attend_units, finish_segment, merge_partials, int4_tiles,
                                 int4_quantize_rows, int4_q8_tiles, int4_q8_quantize_rows, int4_dequantize, rms_norm_rows, rope_rows,
                                 gemv_cols, add_rows, silu_mul_rows, convert, kIntegerDots};
  return &table;
}
}  // namespace tandem

#else

namespace tandem {
const KernelTable* TANDEM_AVX512_TABLE() { return nullptr; }
}  // namespace tandem

#endif
