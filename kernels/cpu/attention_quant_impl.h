// The decode attention over group-quantized KV units (kv_quant.h; kernels/kv_quant.py is the
// spec), included by attention_impl.h after the pieces it shares with the 16-bit path (softmax,
// head state, prefetch, tile heads), once per instruction set.
//
// Codes are widened to fp32 in registers, or (Isa::Dots) multiplied as integers; no dequantized
// copy of a unit is ever written. A key
// score is sum_g scale[g, t] * sum_{d in g} q[d] code[d, t] (+ min[g, t] * sum_{d in g} q[d] for
// INT4): the group's dot product runs on raw codes and is scaled once per group and token. The
// values fold each token's scale into its probability once per block (coef = p * scale), so a code
// costs one fma per head, as a 16-bit element does; INT4's mins add sum_t p[t] min[g, t] to a
// group's channels, kept as running lanes like the softmax sum and added when the head finishes.
//
// An INT4 byte is read as its low nibble and its whole value rather than as two nibbles (one
// instruction fewer per vector: Isa::load_nibbles). Keys fold that into the query, whose channel
// pair (j, j + 32) start_head rewrites as (q_j - q_{j+32} / 16, q_{j+32} / 16); value tiles sum
// p * low and p * byte and turn them into the pair's sums when the tile ends.
#pragma once

#include "attention.h"

namespace tandem {
namespace {

// How a format's codes widen: one load of kWidth bytes gives kVectors vectors. INT8: kWidth
// channels (values) or tokens (keys) of one code row. INT4: the low nibbles (channel j) and the
// whole bytes (whose high nibbles are channel j + 32 of the group), kv_quant's packing.
struct Int8Codes {
  static constexpr int kVectors = 1;
  static constexpr int kGroupBytes = kQuantGroup;  // one token's codes of one group
  static constexpr bool kHasMin = false;
  static TANDEM_ALWAYS_INLINE void load(const uint8_t* p, Vec* v) {
    v[0] = Isa::load_int8(reinterpret_cast<const int8_t*>(p));
  }
};

struct Int4Codes {
  static constexpr int kVectors = 2;
  static constexpr int kGroupBytes = kQuantGroup / 2;
  static constexpr bool kHasMin = true;
  static TANDEM_ALWAYS_INLINE void load(const uint8_t* p, Vec* v) { Isa::load_nibbles(p, &v[0], &v[1]); }
};

inline const Float16* unit_scales(const uint8_t* unit, const KvUnit& u) {  // [num_groups, block_size]
  return reinterpret_cast<const Float16*>(unit + u.scales_offset());
}

inline const Float16* unit_mins(const uint8_t* unit, const KvUnit& u) {  // [num_groups, block_size], INT4
  return reinterpret_cast<const Float16*>(unit + u.mins_offset());
}

// One head's score terms of key group g over the span at t0: s = scale * sums (+ min[g] * q_sum for
// INT4), added to what earlier groups left (group 0 writes).
template <class Codes>
TANDEM_ALWAYS_INLINE void add_group_score(float* s, Vec scale, Vec sums, const uint8_t* unit, const KvUnit& u, int g,
                                          int t0, float q_sum) {
  Vec total = Isa::fma(scale, sums, g == 0 ? Isa::zero() : Isa::load(s));
  if constexpr (Codes::kHasMin) {
    total = Isa::fma(Isa::load(unit_mins(unit, u) + g * u.block_size + t0), Isa::set1(q_sum), total);
  }
  Isa::store(s, total);
}

// Scores of kHeads query rows (q [heads, head_dim], pre-scaled; q_sums [heads, num_groups])
// against the kWidth tokens at t0 of a key unit, whose codes are [code_cols, block_size]. Per
// group, kPhases accumulator sets take every kPhases-th code row (one load; INT4's holds two
// channels), then the span's scales (and mins) turn the group's sums into score terms. Parts
// [first_part, first_part + num_groups * kPrefetchPieces) of `prefetch` are issued over the rows.
template <class Codes, int kHeads>
TANDEM_ALWAYS_INLINE void score_quantized_span(const float* q, const float* q_sums, const uint8_t* unit,
                                               const KvUnit& u, int t0, float* scores, int score_stride,
                                               const Prefetch& prefetch, int first_part) {
  static_assert(kHeads <= kTile, "tile exceeds the register budget");
  constexpr int kPhases = floor_pow2(kTile / kHeads);
  constexpr int kRows = Codes::kGroupBytes;  // code rows of one group
  static_assert(kRows % kPhases == 0, "phases split a group's rows evenly");
  constexpr int kSteps = kRows / kPhases;
  const int head_dim = u.head_dim;
  const int block_size = u.block_size;
  const int num_groups = u.num_groups();
  for (int g = 0; g < num_groups; ++g) {
    Vec acc[kPhases * kHeads];
#pragma GCC unroll 16
    for (int i = 0; i < kPhases * kHeads; ++i) acc[i] = Isa::zero();
    const uint8_t* rows = unit + static_cast<size_t>(g) * kRows * block_size + t0;
    const float* q_group = q + g * kQuantGroup;
    for (int piece = 0; piece < kPrefetchPieces; ++piece) {
      prefetch.part(first_part + g * kPrefetchPieces + piece);
      const int end = kSteps * (piece + 1) / kPrefetchPieces;
      for (int step = kSteps * piece / kPrefetchPieces; step < end; ++step) {
#pragma GCC unroll 16
        for (int phase = 0; phase < kPhases; ++phase) {
          const int row = step * kPhases + phase;
          Vec k[Codes::kVectors];
          Codes::load(rows + static_cast<size_t>(row) * block_size, k);
#pragma GCC unroll 8
          for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 2
            for (int v = 0; v < Codes::kVectors; ++v) {
              const Vec qd = Isa::set1(q_group[h * head_dim + row + v * kRows]);
              acc[phase * kHeads + h] = Isa::fma(qd, k[v], acc[phase * kHeads + h]);
            }
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int phase = 1; phase < kPhases; ++phase) {
#pragma GCC unroll 8
      for (int h = 0; h < kHeads; ++h) acc[h] = Isa::add(acc[h], acc[phase * kHeads + h]);
    }
    const Vec scale = Isa::load(unit_scales(unit, u) + g * block_size + t0);
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      add_group_score<Codes>(scores + h * score_stride, scale, acc[h], unit, u, g, t0, q_sums[h * num_groups + g]);
    }
  }
}

// score_quantized_span by integer dot products (Isa::Dots): the query's int8 codes (q_codes
// [heads, head_dim], q_steps and q_code_sums [heads, num_groups]) against the key codes, 4 code
// rows at a time turned into one token's 4 codes per 32-bit lane, multiplied as u8 x s8 with 4
// query codes broadcast. INT8 codes become u8 by adding 128 (their sign bit flipped), taken off
// again as 128 times the query codes' sum; INT4's low nibbles of rows j..j+3 are channels j..j+3
// and the high ones channels j + 32..j + 35. A group's integer sums times the query step and the
// keys' scales are its score terms, plus the mins' term for INT4 (q_sums: the int8 query's sums).
template <class Codes, int kHeads, class I = Isa>
TANDEM_ALWAYS_INLINE void score_dotted_span(const int8_t* q_codes, const float* q_steps, const int32_t* q_code_sums,
                                            const float* q_sums, const uint8_t* unit, const KvUnit& u, int t0,
                                            float* scores, int score_stride, const Prefetch& prefetch, int first_part) {
  using Dots = typename I::Dots;  // dependent: Isa may have none, and then this is never instantiated
  using IVec = typename Dots::IVec;
  constexpr int kPhases = 2;  // independent accumulator sets: dot products' latency
  static_assert(kPhases * kHeads <= kTile, "tile exceeds the register budget");
  constexpr int kRows = Codes::kGroupBytes;  // code rows of one group
  constexpr int kSteps = kRows / 4 / kPhases;
  constexpr int kInt8Offset = 128;
  const int head_dim = u.head_dim;
  const int block_size = u.block_size;
  const int num_groups = u.num_groups();
  for (int g = 0; g < num_groups; ++g) {
    IVec acc[kPhases * kHeads];
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      acc[h] = Dots::set1(Codes::kHasMin ? 0 : -kInt8Offset * q_code_sums[h * num_groups + g]);
      acc[kHeads + h] = Dots::zero();
    }
    const uint8_t* rows = unit + static_cast<size_t>(g) * kRows * block_size + t0;
    const int8_t* q_group = q_codes + g * kQuantGroup;
    for (int piece = 0; piece < kPrefetchPieces; ++piece) {
      prefetch.part(first_part + g * kPrefetchPieces + piece);
      const int end = kSteps * (piece + 1) / kPrefetchPieces;
      for (int step = kSteps * piece / kPrefetchPieces; step < end; ++step) {
#pragma GCC unroll 2
        for (int phase = 0; phase < kPhases; ++phase) {
          const int row = (step * kPhases + phase) * 4;
          const IVec k = Dots::load_key_quad(rows + static_cast<size_t>(row) * block_size, block_size);
          if constexpr (Codes::kHasMin) {
            const IVec low = Dots::low_nibbles(k);
            const IVec high = Dots::high_nibbles(k);
#pragma GCC unroll 8
            for (int h = 0; h < kHeads; ++h) {
              const int8_t* q = q_group + h * head_dim + row;
              IVec& a = acc[phase * kHeads + h];
              a = Dots::dot(Dots::dot(a, low, q), high, q + kQuantGroup / 2);
            }
          } else {
            const IVec biased = Dots::flip_sign(k);
#pragma GCC unroll 8
            for (int h = 0; h < kHeads; ++h) {
              acc[phase * kHeads + h] = Dots::dot(acc[phase * kHeads + h], biased, q_group + h * head_dim + row);
            }
          }
        }
      }
    }
    const Vec scale = Isa::load(unit_scales(unit, u) + g * block_size + t0);
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const Vec sums = Dots::to_float(Dots::add(acc[h], acc[kHeads + h]));
      const Vec step_scale = Isa::mul(scale, Isa::set1(q_steps[h * num_groups + g]));
      add_group_score<Codes>(scores + h * score_stride, step_scale, sums, unit, u, g, t0, q_sums[h * num_groups + g]);
    }
  }
}

// Scores of every query row of the group against the tokens [0, num_tokens) of a key unit;
// columns [num_tokens, score_stride) come out as -inf (stale slots' scales may be anything).
// block_size is a multiple of every kWidth, so spans never pass the unit's end. The next unit
// is prefetched over the first pass when next_unit is set.
template <class Codes>
inline void score_quantized_block(const HeadState& state, const uint8_t* unit, const KvUnit& u, int group_size,
                                  int num_tokens, float* scores, int score_stride, const uint8_t* next_unit) {
  constexpr int kPassHeads = min_int(kIntegerDots ? kTile / 2 : kTile, kMaxTileHeads);  // dots: 2 phases
  const int num_groups = u.num_groups();
  const int num_spans = (num_tokens + kWidth - 1) / kWidth;
  const Prefetch prefetch = Prefetch::of(next_unit, u.bytes(), num_spans * num_groups * kPrefetchPieces);
  const Prefetch none;
  for (int span = 0; span < num_spans; ++span) {
    const int t0 = span * kWidth;
    for (int h = 0; h < group_size; h += kPassHeads) {
      with_tile_heads(min_int(group_size - h, kPassHeads), [&](auto heads) {
        constexpr int kHeads = decltype(heads)::value;
        const Prefetch& issue = h == 0 ? prefetch : none;
        const int first_part = span * num_groups * kPrefetchPieces;
        float* span_scores = scores + h * score_stride + t0;
        const float* q_sums = state.q_sums + h * num_groups;
        if constexpr (kIntegerDots && kHeads <= kPassHeads) {
          score_dotted_span<Codes, kHeads>(state.q_codes + h * u.head_dim, state.q_steps + h * num_groups,
                                           state.q_code_sums + h * num_groups, q_sums, unit, u, t0, span_scores,
                                           score_stride, issue, first_part);
        } else if constexpr (kHeads <= kPassHeads) {
          score_quantized_span<Codes, kHeads>(state.q + h * u.head_dim, q_sums, unit, u, t0, span_scores,
                                              score_stride, issue, first_part);
        }
      });
    }
  }
  for (int h = 0; h < group_size; ++h) {
    for (int t = num_tokens; t < score_stride; ++t) scores[h * score_stride + t] = -__builtin_inff();
  }
}

// coef [num_groups, group_size, stride] = probs [group_size, stride] times each group's scales, over
// the vectors covering num_tokens: a value code's weight in its head's sum.
inline void fold_value_scales(const float* probs, int stride, const uint8_t* unit, const KvUnit& u, int group_size,
                              int num_tokens, float* coef) {
  const Float16* scales = unit_scales(unit, u);
  for (int g = 0; g < u.num_groups(); ++g) {
    for (int h = 0; h < group_size; ++h) {
      float* out = coef + static_cast<size_t>(g * group_size + h) * stride;
      for (int t = 0; t < num_tokens; t += kWidth) {
        Isa::store(out + t, Isa::mul(Isa::load(probs + h * stride + t), Isa::load(scales + g * u.block_size + t)));
      }
    }
  }
}

// Vector i of a value tile's loads covers channels channel_of(i) .. + kWidth from the tile's first.
template <class Codes>
constexpr int tile_channel(int i) {
  return (i / Codes::kVectors) * kWidth + (i % Codes::kVectors) * Codes::kGroupBytes;
}

// An INT4 value tile's sums of p * low and p * byte, per load, added to its channel pair: the low
// channels take the first, the high ones (byte - low) / 16.
template <class Codes, int kHeads, int kLoads>
TANDEM_ALWAYS_INLINE void add_nibble_sums(const Vec* sums, float* acc, int head_dim) {
  const Vec inverse_weight = Isa::set1(1.0f / kNibbleWeight);
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 8
    for (int l = 0; l < kLoads; ++l) {
      const Vec low = sums[(h * kLoads + l) * 2];
      const Vec byte = sums[(h * kLoads + l) * 2 + 1];
      float* low_channels = acc + h * head_dim + tile_channel<Codes>(2 * l);
      float* high_channels = acc + h * head_dim + tile_channel<Codes>(2 * l + 1);
      Isa::store(low_channels, Isa::add(Isa::load(low_channels), low));
      Isa::store(high_channels, Isa::fma(Isa::sub(byte, low), inverse_weight, Isa::load(high_channels)));
    }
  }
}

// acc[h, the tile's channels] += sum_t coef[h, t] * code[t, channel] for kLoads loads of kWidth
// bytes from each token's row (codes: the tile's first byte in token 0's row; acc: the tile's
// first channel of head 0). kHeads * kVectors * kLoads accumulators stay in registers. Part
// first_part + t of `prefetch` is issued at token t.
template <class Codes, int kHeads, int kLoads>
TANDEM_ALWAYS_INLINE void value_quantized_tile(const float* coef, int coef_stride, const uint8_t* codes,
                                               size_t code_cols, int num_tokens, float* acc, int head_dim,
                                               const Prefetch& prefetch, int first_part) {
  constexpr int kVecs = kLoads * Codes::kVectors;
  constexpr bool kBytes = Codes::kVectors == 2;  // INT4: sums of p * low and p * byte, from zero
  Vec a[kHeads * kVecs];
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) {
      a[h * kVecs + i] = kBytes ? Isa::zero() : Isa::load(acc + h * head_dim + tile_channel<Codes>(i));
    }
  }
  for (int t = 0; t < num_tokens; ++t) {
    prefetch.part(first_part + t);
    Vec v[kVecs];
#pragma GCC unroll 16
    for (int l = 0; l < kLoads; ++l) Codes::load(codes + t * code_cols + l * kWidth, v + l * Codes::kVectors);
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const Vec p = Isa::set1(coef[h * coef_stride + t]);
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) a[h * kVecs + i] = Isa::fma(p, v[i], a[h * kVecs + i]);
    }
  }
  if constexpr (kBytes) {
    add_nibble_sums<Codes, kHeads, kLoads>(a, acc, head_dim);
  } else {
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) Isa::store(acc + h * head_dim + tile_channel<Codes>(i), a[h * kVecs + i]);
    }
  }
}

// One group's channels of kHeads heads, in tiles of as many loads as the registers hold (a tile
// stays inside the group: one coefficient per token and head). The first tile issues parts
// [first_part, first_part + num_tokens) of `prefetch`, one a token.
template <class Codes, int kHeads>
inline void value_quantized_group(const float* coef, int coef_stride, const uint8_t* codes, size_t code_cols,
                                  int num_tokens, float* acc, int head_dim, const Prefetch& prefetch,
                                  int first_part) {
  constexpr int kLoadsPerGroup = Codes::kGroupBytes / kWidth;
  constexpr int kFit = kTile / (kHeads * Codes::kVectors);
  constexpr int kLoads = kFit < 1 ? 1 : min_int(kFit, kLoadsPerGroup);
  const Prefetch none;
  constexpr int kWholeTiles = kLoadsPerGroup / kLoads;
  for (int tile = 0; tile < kWholeTiles; ++tile) {
    const int l = tile * kLoads;
    value_quantized_tile<Codes, kHeads, kLoads>(coef, coef_stride, codes + l * kWidth, code_cols, num_tokens,
                                                acc + l * kWidth, head_dim, tile == 0 ? prefetch : none, first_part);
  }
  for (int l = kWholeTiles * kLoads; l < kLoadsPerGroup; ++l) {  // the loads a whole tile leaves over
    value_quantized_tile<Codes, kHeads, 1>(coef, coef_stride, codes + l * kWidth, code_cols, num_tokens,
                                           acc + l * kWidth, head_dim, none, first_part);
  }
}

// acc [group_size, head_dim] += the block's value codes weighted by coef (fold_value_scales). The
// next unit is prefetched over the first pass, a share at each token (in bursts, the prefetches
// stalled on the line fill buffers).
template <class Codes>
inline void accumulate_quantized_block(const float* coef, int stride, const uint8_t* unit, const KvUnit& u,
                                       int group_size, int num_tokens, float* acc, const uint8_t* next_unit) {
  // INT4 loads widen into two vectors: half the heads per pass keep the tile in registers.
  constexpr int kPassHeads = min_int(kMaxTileHeads, kTile / Codes::kVectors);
  const Prefetch prefetch = Prefetch::of(next_unit, u.bytes(), u.num_groups() * num_tokens);
  const Prefetch none;
  for (int g = 0; g < u.num_groups(); ++g) {
    for (int h = 0; h < group_size; h += kPassHeads) {
      with_tile_heads(min_int(group_size - h, kPassHeads), [&](auto heads) {
        constexpr int kHeads = decltype(heads)::value;
        if constexpr (kHeads <= kPassHeads) {
          value_quantized_group<Codes, kHeads>(coef + static_cast<size_t>(g * group_size + h) * stride, stride,
                                               unit + g * Codes::kGroupBytes, u.code_cols(), num_tokens,
                                               acc + h * u.head_dim + g * kQuantGroup, u.head_dim,
                                               h == 0 ? prefetch : none, g * num_tokens);
        }
      });
    }
  }
}

// Values by integer dot products (Isa::Dots): per group and head, the block's coefficients
// p * scale (p <= 1 after the running max, scales >= 0) are rounded to u8 codes with one step,
// their largest / 255, each token's weight within 1/510 of the block's largest. Four tokens' value
// codes then meet their 4 coefficient codes in one dot product per lane, summed exactly in int32,
// and each block's sums times its step join the fp32 accumulator, which stays in the Dots' quad
// order until the head finishes (to_channel_order).
//
// The coefficient codes of (g, h) take the first bytes of its row of `coef` (value_coefficients:
// [num_groups, group_size, stride] floats), the step its last float; codes past num_tokens are 0.
template <class I = Isa>
inline void quantize_value_coefficients(const float* probs, int stride, const uint8_t* unit, const KvUnit& u,
                                        int group_size, int num_tokens, float* coef) {
  using Dots = typename I::Dots;
  const int whole = num_tokens / kWidth * kWidth;
  for (int g = 0; g < u.num_groups(); ++g) {
    const Float16* scales = unit_scales(unit, u) + g * u.block_size;
    for (int h = 0; h < group_size; ++h) {
      const float* p = probs + h * stride;
      float* row = coef + static_cast<size_t>(g * group_size + h) * stride;
      uint8_t* codes = reinterpret_cast<uint8_t*>(row);
      Vec largest = Isa::zero();
      for (int t = 0; t < whole; t += kWidth) largest = Isa::max(largest, Isa::mul(Isa::load(p + t), Isa::load(scales + t)));
      float max_coefficient = Isa::reduce_max(largest);
      for (int t = whole; t < num_tokens; ++t) max_coefficient = max_float(max_coefficient, p[t] * half_to_float(scales[t].bits));
      const Vec inverse = Isa::set1(max_coefficient > 0.0f ? 255.0f / max_coefficient : 0.0f);
      for (int t = 0; t < num_tokens; t += kWidth) {
        Dots::store_coefficients(codes + t, Isa::mul(Isa::load(p + t), Isa::load(scales + t)), inverse);
      }
      for (int t = num_tokens; t < stride; ++t) codes[t] = 0;  // stale slots' scales may be anything
      row[stride - 1] = max_coefficient / 255.0f;
    }
  }
}

// acc[h, the group's 64 channels in quad order] += the group's value codes of the block weighted by
// the coefficient codes (rows: head 0's row of this group in `coef`), kHeads x 4 accumulators in
// registers. Part first_part + t / 4 of `prefetch` is issued at token t.
template <class Codes, int kHeads, class I = Isa>
TANDEM_ALWAYS_INLINE void value_dotted_group(const float* rows, int stride, const uint8_t* codes, size_t code_cols,
                                             int num_tokens, float* acc, int head_dim, const Prefetch& prefetch,
                                             int first_part) {
  using Dots = typename I::Dots;
  using IVec = typename Dots::IVec;
  constexpr int kVecs = kQuantGroup / kWidth;
  IVec a[kHeads * kVecs];
#pragma GCC unroll 16
  for (int i = 0; i < kHeads * kVecs; ++i) a[i] = Dots::zero();
  for (int t = 0; t < num_tokens; t += 4) {
    prefetch.part(first_part + t / 4);
    IVec v[kVecs];
    if constexpr (Codes::kHasMin) {
      Dots::load_int4_values(codes + t * code_cols, code_cols, v);
    } else {
      Dots::load_int8_values(codes + t * code_cols, code_cols, v);
    }
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const uint8_t* c = reinterpret_cast<const uint8_t*>(rows + h * stride) + t;
#pragma GCC unroll 4
      for (int k = 0; k < kVecs; ++k) a[h * kVecs + k] = Dots::dot_values(a[h * kVecs + k], v[k], c);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
    const Vec step = Isa::set1(rows[h * stride + stride - 1]);
    float* out = acc + h * head_dim;
#pragma GCC unroll 4
    for (int k = 0; k < kVecs; ++k) {
      Isa::store(out + k * kWidth, Isa::fma(step, Dots::to_float(a[h * kVecs + k]), Isa::load(out + k * kWidth)));
    }
  }
}

// accumulate_quantized_block by integer dot products, from quantize_value_coefficients' codes.
template <class Codes, class I = Isa>
inline void accumulate_dotted_block(const float* coef, int stride, const uint8_t* unit, const KvUnit& u,
                                    int group_size, int num_tokens, float* acc, const uint8_t* next_unit) {
  constexpr int kPassHeads = 4;  // x 4 accumulators, plus 4 value vectors, in 32 registers
  const int num_quads = (num_tokens + 3) / 4;
  const Prefetch prefetch = Prefetch::of(next_unit, u.bytes(), u.num_groups() * num_quads);
  const Prefetch none;
  for (int g = 0; g < u.num_groups(); ++g) {
    for (int h = 0; h < group_size; h += kPassHeads) {
      with_tile_heads(min_int(group_size - h, kPassHeads), [&](auto heads) {
        constexpr int kHeads = decltype(heads)::value;
        if constexpr (kHeads <= kPassHeads) {
          value_dotted_group<Codes, kHeads, I>(coef + static_cast<size_t>(g * group_size + h) * stride, stride,
                                               unit + g * Codes::kGroupBytes, u.code_cols(), num_tokens,
                                               acc + h * u.head_dim + g * kQuantGroup, u.head_dim,
                                               h == 0 ? prefetch : none, g * num_quads);
        }
      });
    }
  }
}

// INT4: min_lanes[h, g] += probs[h, t] * min[g, t] over the block's tokens, lane by lane: every
// channel of group g takes sum_t p[t] min[g, t], summed once when the head finishes (add_min_lanes)
// rather than reduced per block. Stale slots' mins (which may be anything) are read as 0.
inline void accumulate_value_mins(const float* probs, int stride, const uint8_t* unit, const KvUnit& u,
                                  int group_size, int num_tokens, float* min_lanes) {
  const int num_groups = u.num_groups();
  const int whole = num_tokens / kWidth * kWidth;
  for (int g = 0; g < num_groups; ++g) {
    const Float16* mins = unit_mins(unit, u) + g * u.block_size;
    float tail[kWidth];  // the last partial span's mins, stale slots zeroed
    if (whole < num_tokens) {
      Isa::store(tail, Isa::load(mins + whole));
      for (int t = num_tokens - whole; t < kWidth; ++t) tail[t] = 0.0f;
    }
    for (int h = 0; h < group_size; ++h) {
      const float* p = probs + h * stride;
      float* lanes = min_lanes + (h * num_groups + g) * kWidth;
      Vec sum = Isa::load(lanes);
      for (int t = 0; t < whole; t += kWidth) sum = Isa::fma(Isa::load(p + t), Isa::load(mins + t), sum);
      if (whole < num_tokens) sum = Isa::fma(Isa::load(p + whole), Isa::load(tail), sum);
      Isa::store(lanes, sum);
    }
  }
}

// attend_units_typed for a quantized pool: the same walk over units, the same softmax and head
// state, with the codes scored and accumulated by the functions above. The key and value pools
// may hold different codes (K8V4), so each has its own unit size.
template <class KeyCodes, class ValueCodes>
void attend_quantized_units(const Problem& p, const Segment& piece, int64_t segment_begin, int64_t prefetch_end,
                            float* scratch) {
  const int group_size = p.group_size();
  const int num_kv_heads = p.num_kv_heads;
  const int score_stride = static_cast<int>(score_stride_floats(p));
  const KvUnit key_unit{key_unit_dtype(p.kv_dtype), p.head_dim, p.block_size};
  const KvUnit value_unit{value_unit_dtype(p.kv_dtype), p.head_dim, p.block_size};
  float* scores = scratch;  // [group_size, score_stride]
  float* coef = value_coefficients(p, scratch);
  const uint8_t* key_cache = static_cast<const uint8_t*>(p.key_cache);
  const uint8_t* value_cache = static_cast<const uint8_t*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<size_t>(piece.seq) * p.max_blocks_per_seq;
  const int context_len = p.context_lens[piece.seq];

  const auto unit_start = [&](int64_t unit, const KvUnit& u) {  // byte offset in u's pool
    return (static_cast<size_t>(table[unit / num_kv_heads]) * num_kv_heads + unit % num_kv_heads) * u.bytes();
  };

  for (int64_t unit = piece.unit_begin; unit < piece.unit_end; ++unit) {
    const int b = static_cast<int>(unit / num_kv_heads);
    const int kv_head = static_cast<int>(unit % num_kv_heads);
    const HeadState state = head_state(p, scratch, kv_head);
    if (unit < segment_begin + num_kv_heads) start_head(p, piece.seq, kv_head, state);
    const int num_tokens = min_int(p.block_size, context_len - b * p.block_size);
    const bool has_next = unit + 1 < prefetch_end;  // as attend_units_typed: the next unit's bytes ahead
    const uint8_t* keys = key_cache + unit_start(unit, key_unit);
    const uint8_t* values = value_cache + unit_start(unit, value_unit);
    score_quantized_block<KeyCodes>(state, keys, key_unit, group_size, num_tokens, scores, score_stride,
                                    has_next ? key_cache + unit_start(unit + 1, key_unit) : nullptr);
    touch_lines(values, value_unit.bytes());
    softmax_update(scores, score_stride, group_size, p.head_dim, state.run_max, state.sum_lanes, state.acc,
                   state.min_lanes, ValueCodes::kHasMin ? value_unit.num_groups() : 0);
    const uint8_t* next_values = has_next ? value_cache + unit_start(unit + 1, value_unit) : nullptr;
    if constexpr (kIntegerDots) {
      quantize_value_coefficients(scores, score_stride, values, value_unit, group_size, num_tokens, coef);
      accumulate_dotted_block<ValueCodes>(coef, score_stride, values, value_unit, group_size, num_tokens, state.acc,
                                          next_values);
    } else {
      fold_value_scales(scores, score_stride, values, value_unit, group_size, num_tokens, coef);
      accumulate_quantized_block<ValueCodes>(coef, score_stride, values, value_unit, group_size, num_tokens,
                                             state.acc, next_values);
    }
    if constexpr (ValueCodes::kHasMin) {
      accumulate_value_mins(scores, score_stride, values, value_unit, group_size, num_tokens, state.min_lanes);
    }
  }
}

}  // namespace
}  // namespace tandem
