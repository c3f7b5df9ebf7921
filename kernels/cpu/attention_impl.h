// The decode-attention kernel, written once over an instruction-set traits class.
//
// Each isa_*.cpp translation unit defines `struct Isa` (vector type, width, loads
// with bf16/fp16 widening, fma, exp; optionally split bf16 loads and the
// matching interleaved store; INT8 and packed INT4 code loads for quantized
// pools, attention_quant_impl.h) and then includes
// this file, which must be included exactly once per translation unit. Every
// name here has internal linkage (unnamed namespace), so the same inline code
// compiled with different -m flags never merges across translation units.
//
// Arithmetic is fp32, K and V widened on load, except where an Isa attends quantized
// codes by integer dot products (attention_quant_impl.h). The query heads
// that share one kv head are processed together, so every K and V row is read
// once per group rather than once per query head.
#pragma once

#include <type_traits>

#include "attention.h"

namespace tandem {
namespace {

using Vec = Isa::Vec;
constexpr int kWidth = Isa::kWidth;
// Most heads one register tile serves; larger groups take several passes.
constexpr int kMaxTileHeads = 8;
// Accumulators one register tile may hold: AVX-512 (the only 16-lane path) has
// 32 vector registers, the others 16.
constexpr int kTile = kWidth >= 16 ? 16 : 8;

// The tile functions must inline into their loops: as calls, the accumulator
// arrays would go through the stack.
#define TANDEM_ALWAYS_INLINE __attribute__((always_inline)) inline

constexpr int min_int(int a, int b) { return a < b ? a : b; }
inline float max_float(float a, float b) { return a > b ? a : b; }

constexpr size_t kCacheLine = 64;

// Read prefetches into all cache levels. The builtin is written here, not in a
// helper: GCC marks a function that only prefetches as free of side effects
// and deletes its calls (which silently removed every prefetch once).
TANDEM_ALWAYS_INLINE void prefetch_lines(const void* start, size_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (size_t offset = 0; offset < bytes; offset += kCacheLine) __builtin_prefetch(p + offset, 0, 3);
}

// Reads one byte of every cache line of [start, start + bytes) in address order.
// Done on a unit's value rows between its scoring and its softmax: these loads
// wait on no arithmetic, so whatever rows the prefetches have not yet brought in
// are requested together, in the order the hardware prefetchers follow, and
// arrive while the softmax runs (the value pass reads the rows column-wise).
// ~1.08x, median of 15 side-by-side rounds, 2 threads streaming from DRAM.
inline void touch_lines(const void* start, size_t bytes) {
  const volatile char* p = static_cast<const volatile char*>(start);
  for (size_t offset = 0; offset < bytes; offset += kCacheLine) static_cast<void>(p[offset]);
}

// Whether Isa can load bf16 split into even and odd elements (load_even/load_odd).
template <class I, class = void>
struct HasSplitLoads : std::false_type {};
template <class I>
struct HasSplitLoads<
    I, std::void_t<decltype(static_cast<void>(I::load_even(static_cast<const BFloat16*>(nullptr))))>>
    : std::true_type {};

// Whether Isa attends quantized KV by integer dot products, keys and values alike (Isa::Dots,
// attention_quant_impl.h).
template <class I, class = void>
struct HasIntegerDots : std::false_type {};
template <class I>
struct HasIntegerDots<I, std::void_t<typename I::Dots>> : std::true_type {};
constexpr bool kIntegerDots = HasIntegerDots<Isa>::value;

// Whether Isa can store an even and an odd vector interleaved (the inverse of the split loads).
template <class I, class = void>
struct HasInterleavedStore : std::false_type {};
template <class I>
struct HasInterleavedStore<
    I, std::void_t<decltype(I::store_interleaved(static_cast<float*>(nullptr), I::zero(), I::zero()))>>
    : std::true_type {};

// Reads chunk c (kWidth lanes, widened to fp32) of a value row. Split rows
// (bf16 with head_dim a multiple of 2 * kWidth) are read in "split order": each
// span of 2 * kWidth elements as its even elements, then its odd ones, which
// widens with half the instructions of the in-order path. The accumulator is
// kept in the same order and permuted back at the end (from_split_order).
// kParity must be c's parity.
template <class Kv, bool kSplit>
struct Rows {
  template <int kParity, class I = Isa>
  static TANDEM_ALWAYS_INLINE Vec load(const Kv* row, int c) {
    if constexpr (kSplit) {
      const Kv* span = row + (c & ~1) * kWidth;
      return kParity == 0 ? I::load_even(span) : I::load_odd(span);
    } else {
      return I::load(row + c * kWidth);
    }
  }
};

// Permutes each of `rows` rows of head_dim floats from split order back to natural order.
template <class I = Isa>
inline void from_split_order(float* data, int rows, int head_dim) {
  for (int start = 0; start < rows * head_dim; start += 2 * kWidth) {
    if constexpr (HasInterleavedStore<I>::value) {
      I::store_interleaved(data + start, I::load(data + start), I::load(data + start + kWidth));
    } else {
      float span[2 * kWidth];
      for (int i = 0; i < kWidth; ++i) {
        span[2 * i] = data[start + i];
        span[2 * i + 1] = data[start + kWidth + i];
      }
      for (int i = 0; i < 2 * kWidth; ++i) data[start + i] = span[i];
    }
  }
}

// Loads `count` elements (a multiple of kWidth) of any dtype into fp32, times `scale`.
inline void load_row(const void* src, DType dtype, size_t offset, int count, float scale,
                     float* dst) {
  const Vec s = Isa::set1(scale);
  for (int i = 0; i < count; i += kWidth) {
    Vec v;
    switch (dtype) {
      case DType::kFloat32: v = Isa::load(static_cast<const float*>(src) + offset + i); break;
      case DType::kBFloat16: v = Isa::load(static_cast<const BFloat16*>(src) + offset + i); break;
      default: v = Isa::load(static_cast<const Float16*>(src) + offset + i); break;
    }
    Isa::store(dst + i, Isa::mul(v, s));
  }
}

// Stores `count` fp32 values times `scale` as `dtype`.
inline void store_row(const float* src, float scale, int count, void* dst, DType dtype,
                      size_t offset) {
  const Vec s = Isa::set1(scale);
  for (int i = 0; i < count; i += kWidth) {
    const Vec v = Isa::mul(Isa::load(src + i), s);
    switch (dtype) {
      case DType::kFloat32: Isa::store(static_cast<float*>(dst) + offset + i, v); break;
      case DType::kBFloat16: Isa::store(static_cast<BFloat16*>(dst) + offset + i, v); break;
      default: Isa::store(static_cast<Float16*>(dst) + offset + i, v); break;
    }
  }
}

// The cache lines of [start, start + bytes) cut into `parts` nearly equal
// parts, prefetched one part at a time so the requests are spread over the
// work instead of flooding the miss buffers at once. A default Prefetch does nothing.
// Counts are 32-bit: a 64-bit division per part cost several percent of a quantized unit's time.
struct Prefetch {
  const char* start = nullptr;
  uint32_t lines = 0;
  uint32_t parts = 1;

  static Prefetch of(const void* start, size_t bytes, int parts) {
    if (start == nullptr) return Prefetch{};
    return Prefetch{static_cast<const char*>(start), static_cast<uint32_t>((bytes + kCacheLine - 1) / kCacheLine),
                    static_cast<uint32_t>(parts)};
  }
  TANDEM_ALWAYS_INLINE void part(int i) const {
    if (start == nullptr) return;
    const uint32_t first = static_cast<uint32_t>(i) * lines / parts;
    const uint32_t end = static_cast<uint32_t>(i + 1) * lines / parts;
    prefetch_lines(start + static_cast<size_t>(first) * kCacheLine, static_cast<size_t>(end - first) * kCacheLine);
  }
};

// Calls f(std::integral_constant<int, n>{}) for n = min(heads, kMaxTileHeads), so
// the tile functions get their head count at compile time.
template <class F>
TANDEM_ALWAYS_INLINE void with_tile_heads(int heads, F&& f) {
  switch (min_int(heads, kMaxTileHeads)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}
static_assert(kMaxTileHeads == 8, "with_tile_heads covers 1..8 heads");

// Keys are stored transposed within a unit, [head_dim, block_size] ("key
// columns"): row d holds element d of every token. A vector load then takes
// kWidth tokens, the score tile's lanes are tokens, and each score comes out of
// an fma chain with no horizontal sum (1.45x faster scoring than dot products
// over head_dim with a reduce8 per tile, L1-resident, g=4, head_dim 128, AVX2).
// Split key rows (bf16, block_size a multiple of 2 * kWidth, Isa with
// store_interleaved) load 2 * kWidth tokens at once as the even tokens and the
// odd ones, interleaved back when the scores are stored (HasInterleavedStore).

constexpr int floor_pow2(int n) { return n >= 2 ? 2 * floor_pow2(n / 2) : 1; }

// Key row loads interleaved with next-unit prefetches: each tile's rows are
// walked in this many pieces, a share of the prefetches before each.
constexpr int kPrefetchPieces = 8;

// Scores of kHeads query rows against the kSpan tokens [t0, t0 + kSpan) of a
// unit's key columns (row stride `row_stride`). Each of kPhases accumulator sets
// sums every kPhases-th row, so heads * token vectors * phases chains keep the
// fma pipes busy even for one head; they are added at the end. When prefetch
// is set, parts [first_part, first_part + kPrefetchPieces) of the next unit's
// `parts` are prefetched over the rows. q is [heads, head_dim], natural order.
template <class Kv, bool kSplit, int kHeads, class I = Isa>  // I: split members looked up only when used
TANDEM_ALWAYS_INLINE void score_span(const float* q, const Kv* keys, int head_dim, int row_stride,
                                     float* scores, int score_stride, const Prefetch& prefetch,
                                     int first_part) {
  constexpr int kVecs = kSplit ? 2 : 1;
  static_assert(kHeads * kVecs <= kTile, "tile exceeds the register budget");
  constexpr int kPhases = floor_pow2(kTile / (kHeads * kVecs));
  constexpr int kChains = kHeads * kVecs;
  Vec acc[kPhases * kChains];
#pragma GCC unroll 16
  for (int i = 0; i < kPhases * kChains; ++i) acc[i] = Isa::zero();
  const int steps = head_dim / kPhases;  // head_dim is a multiple of 16 >= kPhases
  for (int piece = 0; piece < kPrefetchPieces; ++piece) {
    prefetch.part(first_part + piece);
    const int end = steps * (piece + 1) / kPrefetchPieces;
    for (int step = steps * piece / kPrefetchPieces; step < end; ++step) {
#pragma GCC unroll 16
      for (int phase = 0; phase < kPhases; ++phase) {
        const int d = step * kPhases + phase;
        const Kv* row = keys + static_cast<size_t>(d) * row_stride;
        Vec k[kVecs];
        if constexpr (kSplit) {
          k[0] = I::load_even(row);
          k[1] = I::load_odd(row);
        } else {
          k[0] = Isa::load(row);
        }
#pragma GCC unroll 8
        for (int h = 0; h < kHeads; ++h) {
          const Vec qd = Isa::set1(q[h * head_dim + d]);
#pragma GCC unroll 2
          for (int v = 0; v < kVecs; ++v) {
            acc[phase * kChains + h * kVecs + v] = Isa::fma(qd, k[v], acc[phase * kChains + h * kVecs + v]);
          }
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int phase = 1; phase < kPhases; ++phase) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = Isa::add(acc[i], acc[phase * kChains + i]);
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
    if constexpr (kSplit) {
      I::store_interleaved(scores + h * score_stride, acc[2 * h], acc[2 * h + 1]);
    } else {
      Isa::store(scores + h * score_stride, acc[h]);
    }
  }
}

// Scores of every query row of the group against the tokens [0, num_tokens) of
// a unit's key columns [head_dim, block_size]; columns [num_tokens,
// score_stride) come out as -inf. Token spans that block_size does not fill
// are copied, zero-padded, into `tail` ([head_dim, kTailRowFloats] floats) and
// scored there. The next unit's keys are prefetched during the first pass
// over the columns when next_keys is set.
template <class Kv, bool kSplit>
inline void score_block(const float* q, const Kv* keys, int group_size, int head_dim, int block_size,
                        int num_tokens, float* scores, int score_stride, const Kv* next_keys, void* tail) {
  constexpr int kSpan = (kSplit ? 2 : 1) * kWidth;
  static_assert(kSpan * sizeof(Kv) <= kTailRowFloats * sizeof(float), "tail rows hold one span");
  static_assert(kWidth <= kHeadDimMultiple, "a span's scores fit the padded score row");
  constexpr int kPassHeads = min_int(kTile / (kSplit ? 2 : 1), kMaxTileHeads);
  const int num_spans = (num_tokens + kSpan - 1) / kSpan;
  const Prefetch prefetch = Prefetch::of(next_keys, static_cast<size_t>(head_dim) * block_size * sizeof(Kv),
                                         num_spans * kPrefetchPieces);
  const Prefetch none;
  for (int span = 0; span < num_spans; ++span) {
    const int t0 = span * kSpan;
    const Kv* columns = keys + t0;
    int row_stride = block_size;
    if (t0 + kSpan > block_size) {  // a partial span: only where block_size is not a multiple of kSpan
      Kv* rows = static_cast<Kv*>(tail);
      for (int d = 0; d < head_dim; ++d) {
        for (int t = 0; t < kSpan; ++t) {
          rows[d * kSpan + t] = t0 + t < block_size ? keys[static_cast<size_t>(d) * block_size + t0 + t] : Kv{};
        }
      }
      columns = rows;
      row_stride = kSpan;
    }
    for (int h = 0; h < group_size; h += kPassHeads) {
      with_tile_heads(min_int(group_size - h, kPassHeads), [&](auto heads) {
        constexpr int kHeads = decltype(heads)::value;
        if constexpr (kHeads <= kPassHeads) {
          score_span<Kv, kSplit, kHeads>(q + h * head_dim, columns, head_dim, row_stride, scores + h * score_stride + t0,
                                         score_stride, h == 0 ? prefetch : none, span * kPrefetchPieces);
        }
      });
    }
  }
  for (int h = 0; h < group_size; ++h) {
    for (int t = num_tokens; t < score_stride; ++t) scores[h * score_stride + t] = -__builtin_inff();
  }
}

// acc[h, chunks c..c+kChunks) += sum_t probs[h, t] * values[t, same chunks].
// kHeads * kChunks independent accumulators keep the fma pipes busy even for
// one head (no GQA). kParity is c's parity (see Rows).
template <class Kv, bool kSplit, int kHeads, int kChunks, int kParity>
TANDEM_ALWAYS_INLINE void value_tile(const float* probs, int prob_stride, const Kv* values, int head_dim,
                                     int num_tokens, int c, float* acc) {
  static_assert(kHeads * kChunks <= kTile, "tile exceeds the register budget");
  using R = Rows<Kv, kSplit>;
  Vec a[kHeads * kChunks];
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
    for (int j = 0; j < kChunks; ++j) a[h * kChunks + j] = Isa::load(acc + h * head_dim + (c + j) * kWidth);
  }
  for (int t = 0; t < num_tokens; ++t) {
    Vec v[kChunks];
#pragma GCC unroll 16
    for (int j = 0; j < kChunks; ++j) {
      v[j] = (kParity + j) % 2 == 0 ? R::template load<0>(values + t * head_dim, c + j)
                                    : R::template load<1>(values + t * head_dim, c + j);
    }
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const Vec p = Isa::set1(probs[h * prob_stride + t]);
#pragma GCC unroll 16
      for (int j = 0; j < kChunks; ++j) a[h * kChunks + j] = Isa::fma(p, v[j], a[h * kChunks + j]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 16
    for (int j = 0; j < kChunks; ++j) Isa::store(acc + h * head_dim + (c + j) * kWidth, a[h * kChunks + j]);
  }
}

// When next_values is set, the next unit's value rows are prefetched over the
// tiles, a share before each.
template <class Kv, bool kSplit, int kHeads>
inline void value_heads(const float* probs, int prob_stride, const Kv* values, int head_dim,
                        int num_tokens, float* acc, const Kv* next_values) {
  // Split rows need whole spans per tile (an even count) so each tile's chunk
  // parities are known at compile time; a single chunk alternates parities.
  constexpr int kFit = kTile / kHeads;
  constexpr int kChunks = kSplit && kFit >= 2 ? kFit / 2 * 2 : kFit;
  const int num_chunks = head_dim / kWidth;
  const int num_tiles = num_chunks / kChunks + num_chunks % kChunks;
  const Prefetch prefetch = Prefetch::of(next_values, static_cast<size_t>(num_tokens) * head_dim * sizeof(Kv), num_tiles);
  int c = 0;
  for (int tile = 0; c < num_chunks; ++tile) {
    prefetch.part(tile);
    if (c + kChunks <= num_chunks) {
      if (kChunks % 2 == 0 || c % 2 == 0) {
        value_tile<Kv, kSplit, kHeads, kChunks, 0>(probs, prob_stride, values, head_dim, num_tokens, c, acc);
      } else {
        value_tile<Kv, kSplit, kHeads, kChunks, 1>(probs, prob_stride, values, head_dim, num_tokens, c, acc);
      }
      c += kChunks;
    } else {
      if (c % 2 == 0) {
        value_tile<Kv, kSplit, kHeads, 1, 0>(probs, prob_stride, values, head_dim, num_tokens, c, acc);
      } else {
        value_tile<Kv, kSplit, kHeads, 1, 1>(probs, prob_stride, values, head_dim, num_tokens, c, acc);
      }
      ++c;
    }
  }
}

template <class Kv, bool kSplit>
inline void accumulate_block(const float* probs, int prob_stride, const Kv* values,
                             int group_size, int head_dim, int num_tokens, float* acc, const Kv* next_values) {
  for (int h = 0; h < group_size; h += kMaxTileHeads) {
    const float* ph = probs + h * prob_stride;
    float* ah = acc + h * head_dim;
    if (h > 0) next_values = nullptr;  // prefetched during the first pass over the values
    with_tile_heads(group_size - h, [&](auto heads) {
      value_heads<Kv, kSplit, decltype(heads)::value>(ph, prob_stride, values, head_dim, num_tokens, ah, next_values);
    });
  }
}

// Online softmax step for one block: turns scores into probabilities relative
// to the updated running max and rescales the accumulator when the max grew.
// Padding columns [num_tokens, score_stride) hold -inf and come out as 0.
// Each head's running sum stays as kWidth lanes (sum_lanes [group_size, kWidth]),
// summed once at the end rather than by a horizontal reduction per block. Lanes of
// other running sums, extra_lanes [group_size, num_extra, kWidth], are rescaled with them.
inline void softmax_update(float* scores, int score_stride, int group_size, int head_dim,
                           float* run_max, float* sum_lanes, float* acc, float* extra_lanes = nullptr,
                           int num_extra = 0) {
  for (int h = 0; h < group_size; ++h) {
    float* s = scores + h * score_stride;
    Vec m = Isa::set1(run_max[h]);
    for (int t = 0; t < score_stride; t += kWidth) m = Isa::max(m, Isa::load(s + t));
    const float new_max = Isa::reduce_max(m);
    Vec sum = Isa::load(sum_lanes + h * kWidth);
    if (new_max > run_max[h]) {
      const float correction = Isa::exp_scalar(run_max[h] - new_max);
      const Vec cv = Isa::set1(correction);
      sum = Isa::mul(sum, cv);
      float* a = acc + h * head_dim;
      for (int c = 0; c < head_dim; c += kWidth) Isa::store(a + c, Isa::mul(Isa::load(a + c), cv));
      float* extra = extra_lanes + h * num_extra * kWidth;
      for (int i = 0; i < num_extra * kWidth; i += kWidth) Isa::store(extra + i, Isa::mul(Isa::load(extra + i), cv));
      run_max[h] = new_max;
    }
    const Vec mv = Isa::set1(run_max[h]);
    for (int t = 0; t < score_stride; t += kWidth) {
      const Vec p = Isa::exp(Isa::sub(Isa::load(s + t), mv));
      Isa::store(s + t, p);
      sum = Isa::add(sum, p);
    }
    Isa::store(sum_lanes + h * kWidth, sum);
  }
}

// One kv head's running state inside a thread's scratch (head_state_floats).
struct HeadState {
  float* q;          // [group_size, head_dim], pre-scaled
  float* acc;        // [group_size, head_dim] (split order when kValueSplit)
  float* run_max;    // [group_size]
  float* sum_lanes;  // [group_size, kWidth]
  float* q_sums;     // [group_size, quant_groups]: q's sum over each quantization group
  float* min_lanes;  // [group_size, quant_groups, kWidth]: INT4 values' sum of p * min, as lanes
  int8_t* q_codes;   // [group_size, head_dim]: q as int8 codes, one step per quantization group
  float* q_steps;    // [group_size, quant_groups]
  int32_t* q_code_sums;  // [group_size, quant_groups]: the codes' sum (INT8 keys' offset)
};

// A thread's segment scratch (segment_scratch_floats) is the block scores
// [group_size, score_stride], every kv head's state, the tail tile, then the value coefficients.
inline HeadState head_state(const Problem& p, float* scratch, int kv_head) {
  const int g = p.group_size();
  float* base = scratch + g * score_stride_floats(p) + kv_head * head_state_floats(p);
  float* acc = base + g * p.head_dim;
  float* run_max = acc + g * p.head_dim;
  float* sum_lanes = run_max + g;
  float* q_sums = sum_lanes + g * kWidth;
  float* min_lanes = q_sums + g * quant_groups(p);
  float* q_codes = min_lanes + g * quant_groups(p) * kHeadDimMultiple;
  float* q_steps = q_codes + g * p.head_dim / sizeof(float);
  return HeadState{base, acc, run_max, sum_lanes, q_sums, min_lanes, reinterpret_cast<int8_t*>(q_codes), q_steps,
                   reinterpret_cast<int32_t*>(q_steps + g * quant_groups(p))};
}

inline float* tail_tile(const Problem& p, float* scratch) {  // [head_dim, kTailRowFloats]
  return scratch + p.group_size() * score_stride_floats(p) + p.num_kv_heads * head_state_floats(p);
}

inline float* value_coefficients(const Problem& p, float* scratch) {  // value_coefficient_floats
  return tail_tile(p, scratch) + static_cast<size_t>(p.head_dim) * kTailRowFloats;
}

// The query group q [kQuantGroup] (pre-scaled) as integer dot products read it, through
// Isa::Dots: rotated as the stored keys are, then int8 codes round-half-even(q / step) with step
// max|q| / 127 (codes 0 for a zero group); q_sum, the codes' query's sum, is INT4 keys' min term.
template <class I = Isa>
inline void quantize_query_group(float* q, int8_t* codes, float* step, int32_t* code_sum, float* q_sum) {
  I::Dots::quantize_query_group(q, codes, step, code_sum);
  *q_sum = *step * static_cast<float>(*code_sum);
}

// The query terms a quantized cache needs: the INT4 values' min lanes zeroed; where keys are scored
// by integer dot products each group's int8 codes; else each group rotated as the stored keys are,
// q's sum over it (INT4 keys' mins), and for INT4 keys its channel pairs (j, j + 32) rewritten for
// keys read as low nibble and whole byte (attention_quant_impl.h):
// q_j low + q_{j+32} high = (q_j - q_{j+32} / 16) low + q_{j+32} / 16 byte.
inline void start_quantized_query(const Problem& p, const HeadState& state) {
  const int num_groups = static_cast<int>(quant_groups(p));
  const int half = kQuantGroup / 2;
  const Vec inverse_weight = Isa::set1(1.0f / kNibbleWeight);
  for (int h = 0; h < p.group_size(); ++h) {
    for (int g = 0; g < num_groups; ++g) {
      const int index = h * num_groups + g;
      float* q = state.q + h * p.head_dim + g * kQuantGroup;
      Isa::store(state.min_lanes + index * kWidth, Isa::zero());  // INT4 values' mins
      if constexpr (kIntegerDots) {
        quantize_query_group(q, state.q_codes + h * p.head_dim + g * kQuantGroup, state.q_steps + index,
                             state.q_code_sums + index, state.q_sums + index);
        continue;
      }
      hadamard_rotate(q);  // q . k = (q H) . (k H): the stored keys are rotated
      Vec sum = Isa::zero();
      for (int d = 0; d < kQuantGroup; d += kWidth) sum = Isa::add(sum, Isa::load(q + d));
      state.q_sums[index] = Isa::reduce_add(sum);
      if (key_unit_dtype(p.kv_dtype) != DType::kInt4) continue;
      for (int j = 0; j < half; j += kWidth) {
        const Vec high = Isa::mul(Isa::load(q + half + j), inverse_weight);
        Isa::store(q + j, Isa::sub(Isa::load(q + j), high));
        Isa::store(q + half + j, high);
      }
    }
  }
}

void start_head(const Problem& p, int seq, int kv_head, const HeadState& state) {
  const int group_size = p.group_size();
  const size_t first_row = static_cast<size_t>(seq) * p.num_heads + kv_head * group_size;
  load_row(p.query, p.query_dtype, first_row * p.head_dim, group_size * p.head_dim, p.scale, state.q);
  for (int i = 0; i < group_size * p.head_dim; ++i) state.acc[i] = 0.0f;
  for (int h = 0; h < group_size; ++h) {
    state.run_max[h] = -__builtin_inff();
    Isa::store(state.sum_lanes + h * kWidth, Isa::zero());
  }
  if (is_quantized(p.kv_dtype)) start_quantized_query(p, state);
}

// INT4 values: each group's channels take the head's running sum of p * min (its lanes summed).
inline void add_min_lanes(const Problem& p, const HeadState& state) {
  const int num_groups = static_cast<int>(quant_groups(p));
  for (int h = 0; h < p.group_size(); ++h) {
    for (int g = 0; g < num_groups; ++g) {
      const Vec total = Isa::set1(Isa::reduce_add(Isa::load(state.min_lanes + (h * num_groups + g) * kWidth)));
      float* a = state.acc + h * p.head_dim + g * kQuantGroup;
      for (int d = 0; d < kQuantGroup; d += kWidth) Isa::store(a + d, Isa::add(Isa::load(a + d), total));
    }
  }
}

// A quantized pool's value accumulator [count] floats, in Isa::Dots' quad order where values are
// accumulated by integer dot products, put back in channel order one group at a time.
template <class I = Isa>
inline void from_quad_order(float* acc, int count) {
  if constexpr (kIntegerDots) {
    for (int start = 0; start < count; start += kQuantGroup) I::Dots::to_channel_order(acc + start);
  }
}

// Writes a finished head to problem.out, or its partial state to `partial`.
template <bool kValueSplit>
void finish_head(const Problem& p, int seq, int kv_head, const HeadState& state, const PartialState* partial) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  if (kValueSplit) from_split_order(state.acc, group_size, head_dim);
  if (is_quantized(p.kv_dtype)) from_quad_order(state.acc, group_size * head_dim);
  if (value_unit_dtype(p.kv_dtype) == DType::kInt4) add_min_lanes(p, state);
  if (partial != nullptr) {
    for (int h = 0; h < group_size; ++h) {
      partial->max[h] = state.run_max[h];
      partial->sum[h] = Isa::reduce_add(Isa::load(state.sum_lanes + h * kWidth));
    }
    for (int i = 0; i < group_size * head_dim; ++i) partial->acc[i] = state.acc[i];
    return;
  }
  const size_t first_row = static_cast<size_t>(seq) * p.num_heads + kv_head * group_size;
  for (int h = 0; h < group_size; ++h) {
    const float sum = Isa::reduce_add(Isa::load(state.sum_lanes + h * kWidth));
    store_row(state.acc + h * head_dim, 1.0f / sum, head_dim, p.out, p.query_dtype, (first_row + h) * head_dim);
  }
}

// Attends the units [piece.unit_begin, piece.unit_end) of sequence piece.seq in
// order: every covered kv head of a block, then the next block. The piece
// continues the segment that began at unit segment_begin; each kv head's running
// state in scratch is started at that head's first unit in the segment and kept
// between pieces. The scores buffer is shared, as one (block, head) unit is
// finished before the next starts. Units before prefetch_end may be prefetched.
// kKeySplit and kValueSplit: whether key columns and value rows are read split
// (score_span, Rows).
template <class Kv, bool kKeySplit, bool kValueSplit>
void attend_units_typed(const Problem& p, const Segment& piece, int64_t segment_begin, int64_t prefetch_end,
                        float* scratch) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  const int block_size = p.block_size;
  const int num_kv_heads = p.num_kv_heads;
  const int score_stride = static_cast<int>(score_stride_floats(p));
  float* scores = scratch;  // [group_size, score_stride]
  float* tail = tail_tile(p, scratch);

  const Kv* key_cache = static_cast<const Kv*>(p.key_cache);
  const Kv* value_cache = static_cast<const Kv*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<size_t>(piece.seq) * p.max_blocks_per_seq;
  const int context_len = p.context_lens[piece.seq];
  const size_t head_elems = static_cast<size_t>(block_size) * head_dim;
  const size_t block_elems = head_elems * num_kv_heads;

  // Element offset of a unit's key columns or value rows (same size in both caches).
  const auto unit_offset = [&](int64_t unit) {
    return static_cast<size_t>(table[unit / num_kv_heads]) * block_elems + (unit % num_kv_heads) * head_elems;
  };

  for (int64_t unit = piece.unit_begin; unit < piece.unit_end; ++unit) {
    const int b = static_cast<int>(unit / num_kv_heads);
    const int kv_head = static_cast<int>(unit % num_kv_heads);
    const HeadState state = head_state(p, scratch, kv_head);
    if (unit < segment_begin + num_kv_heads) start_head(p, piece.seq, kv_head, state);
    const size_t base = unit_offset(unit);
    const int num_tokens = min_int(block_size, context_len - b * block_size);
    // The next unit's rows are prefetched while this one is worked on: past a
    // block's last head they are anywhere in the pool, out of the hardware
    // prefetchers' reach, and within a block the prefetchers alone fall behind.
    const bool has_next = unit + 1 < prefetch_end;
    const Kv* next_keys = has_next ? key_cache + unit_offset(unit + 1) : nullptr;
    const Kv* next_values = has_next ? value_cache + unit_offset(unit + 1) : nullptr;
    score_block<Kv, kKeySplit>(state.q, key_cache + base, group_size, head_dim, block_size, num_tokens, scores,
                               score_stride, next_keys, tail);
    touch_lines(value_cache + base, static_cast<size_t>(num_tokens) * head_dim * sizeof(Kv));
    softmax_update(scores, score_stride, group_size, head_dim, state.run_max, state.sum_lanes, state.acc);
    accumulate_block<Kv, kValueSplit>(scores, score_stride, value_cache + base, group_size, head_dim, num_tokens,
                                      state.acc, next_values);
  }
}

// Ends a segment whose units attend_units_typed has walked: every kv head it
// covers writes its result, or its partial state where the segment covers only
// some of the head's blocks.
template <bool kValueSplit>
void finish_segment_typed(const Problem& p, const Segment& seg, float* scratch, float* partials) {
  const int num_blocks = num_logical_blocks(p.context_lens[seg.seq], p.block_size);
  for (int kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
    const BlockRange range = head_blocks(seg, kv_head, p.num_kv_heads);
    if (range.empty()) continue;
    const bool whole = range.whole(num_blocks);
    const PartialState partial = whole ? PartialState{} : partial_state(p, partials, kv_head);
    finish_head<kValueSplit>(p, seg.seq, kv_head, head_state(p, scratch, kv_head), whole ? nullptr : &partial);
  }
}

}  // namespace
}  // namespace tandem

#include "attention_quant_impl.h"

namespace tandem {
namespace {

// The KV element type and split reads of one problem, as types.
template <class Kv, bool kKeySplit, bool kValueSplit>
struct Layout {
  using KvType = Kv;
  static constexpr bool kKeys = kKeySplit;
  static constexpr bool kValues = kValueSplit;
};

// Calls f(Layout<...>{}) for the problem's KV dtype; bf16 takes the split reads
// each layout allows. The split instantiations exist only where Isa provides the
// split loads (and, for keys, the interleaved store).
template <class F>
void with_layout(const Problem& p, F&& f) {
  constexpr bool kValuesCanSplit = HasSplitLoads<Isa>::value;
  constexpr bool kKeysCanSplit = HasSplitLoads<Isa>::value && HasInterleavedStore<Isa>::value;
  switch (p.kv_dtype) {
    case DType::kFloat32: f(Layout<float, false, false>{}); return;
    case DType::kFloat16: f(Layout<Float16, false, false>{}); return;
    case DType::kBFloat16: break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: return;  // attend_quantized_units
  }
  const bool keys = kKeysCanSplit && p.block_size % (2 * kWidth) == 0;
  const bool values = kValuesCanSplit && p.head_dim % (2 * kWidth) == 0;
  if (keys && values) {
    f(Layout<BFloat16, kKeysCanSplit, kValuesCanSplit>{});
  } else if (keys) {
    f(Layout<BFloat16, kKeysCanSplit, false>{});
  } else if (values) {
    f(Layout<BFloat16, false, kValuesCanSplit>{});
  } else {
    f(Layout<BFloat16, false, false>{});
  }
}

void attend_units(const Problem& p, const Segment& piece, int64_t segment_begin, int64_t prefetch_end,
                  float* scratch) {
  switch (p.kv_dtype) {
    case DType::kInt8: return attend_quantized_units<Int8Codes, Int8Codes>(p, piece, segment_begin, prefetch_end, scratch);
    case DType::kInt4: return attend_quantized_units<Int4Codes, Int4Codes>(p, piece, segment_begin, prefetch_end, scratch);
    case DType::kK8V4: return attend_quantized_units<Int8Codes, Int4Codes>(p, piece, segment_begin, prefetch_end, scratch);
    default: break;
  }
  with_layout(p, [&](auto layout) {
    using L = decltype(layout);
    attend_units_typed<typename L::KvType, L::kKeys, L::kValues>(p, piece, segment_begin, prefetch_end, scratch);
  });
}

void finish_segment(const Problem& p, const Segment& segment, float* scratch, float* partials) {
  if (is_quantized(p.kv_dtype)) return finish_segment_typed<false>(p, segment, scratch, partials);  // natural order
  with_layout(p, [&](auto layout) { finish_segment_typed<decltype(layout)::kValues>(p, segment, scratch, partials); });
}

// Log-sum-exp merge: out = sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i.
void merge_partials(const Problem& p, int seq, int kv_head, const PartialState* parts,
                    int num_parts) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  const size_t first_row = static_cast<size_t>(seq) * p.num_heads + kv_head * group_size;
  // One head's merged accumulator; head_dim is bounded by the Python wrapper.
  float merged[kMaxHeadDim];
  for (int h = 0; h < group_size; ++h) {
    float m = -__builtin_inff();
    for (int i = 0; i < num_parts; ++i) m = max_float(m, parts[i].max[h]);
    float total = 0.0f;
    for (int c = 0; c < head_dim; c += kWidth) Isa::store(merged + c, Isa::zero());
    for (int i = 0; i < num_parts; ++i) {
      const float w = Isa::exp_scalar(parts[i].max[h] - m);
      total += w * parts[i].sum[h];
      const Vec wv = Isa::set1(w);
      const float* a = parts[i].acc + h * head_dim;
      for (int c = 0; c < head_dim; c += kWidth) {
        Isa::store(merged + c, Isa::fma(wv, Isa::load(a + c), Isa::load(merged + c)));
      }
    }
    store_row(merged, 1.0f / total, head_dim, p.out, p.query_dtype, (first_row + h) * head_dim);
  }
}

}  // namespace
}  // namespace tandem
