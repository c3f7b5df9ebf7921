// The decode-attention kernel, written once over an instruction-set traits class.
//
// Each isa_*.cpp translation unit defines `struct Isa` (vector type, width, loads
// with bf16/fp16 widening, fma, exp, an 8-way horizontal sum) and then includes
// this file, which must be included exactly once per translation unit. Every
// name here has internal linkage (unnamed namespace), so the same inline code
// compiled with different -m flags never merges across translation units.
//
// Arithmetic is fp32 throughout; K and V are widened on load. The query heads
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
// Most key rows one score tile reads at once, bounding its live registers.
constexpr int kMaxTileTokens = 8;
// reduce8's width.
constexpr int kReduceWidth = 8;

// The tile functions must inline into their loops: as calls, the accumulator
// arrays would go through the stack.
#define TANDEM_ALWAYS_INLINE __attribute__((always_inline)) inline

inline int min_int(int a, int b) { return a < b ? a : b; }
inline float max_float(float a, float b) { return a > b ? a : b; }

constexpr size_t kCacheLine = 64;

inline void prefetch_lines(const void* start, size_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (size_t offset = 0; offset < bytes; offset += kCacheLine) Isa::prefetch(p + offset);
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

// Reads chunk c (kWidth lanes, widened to fp32) of a K/V row. Split rows (bf16
// with head_dim a multiple of 2 * kWidth) are read in "split order": each span
// of 2 * kWidth elements as its even elements, then its odd ones, which widens
// with half the instructions of the in-order path. Dot products do not care
// about the order when the query is permuted alike (to_split_order); the value
// accumulator is permuted back at the end. kParity must be c's parity.
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

// Permutes each of `rows` rows of head_dim floats into split order and back.
inline void to_split_order(float* data, int rows, int head_dim) {
  float span[2 * kWidth];
  for (int start = 0; start < rows * head_dim; start += 2 * kWidth) {
    for (int i = 0; i < kWidth; ++i) {
      span[i] = data[start + 2 * i];
      span[kWidth + i] = data[start + 2 * i + 1];
    }
    for (int i = 0; i < 2 * kWidth; ++i) data[start + i] = span[i];
  }
}

inline void from_split_order(float* data, int rows, int head_dim) {
  float span[2 * kWidth];
  for (int start = 0; start < rows * head_dim; start += 2 * kWidth) {
    for (int i = 0; i < kWidth; ++i) {
      span[2 * i] = data[start + i];
      span[2 * i + 1] = data[start + kWidth + i];
    }
    for (int i = 0; i < 2 * kWidth; ++i) data[start + i] = span[i];
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

// Scores of kHeads query rows against kTokens key rows: kHeads * kTokens dot
// products sharing one pass over the key rows, reduced together by reduce8.
// scores is [heads, score_stride]; q is [heads, head_dim].
template <class Kv, bool kSplit, int kHeads, int kTokens>
TANDEM_ALWAYS_INLINE void score_tile(const float* q, const Kv* keys, int head_dim, float* scores,
                                     int score_stride) {
  static_assert(kHeads * kTokens <= kTile, "tile exceeds the register budget");
  using R = Rows<Kv, kSplit>;
  constexpr int kCount = kHeads * kTokens;
  constexpr int kPadded = (kCount + kReduceWidth - 1) / kReduceWidth * kReduceWidth;
  constexpr int kStep = kSplit ? 2 : 1;  // chunks per step: one split span
  const int num_chunks = head_dim / kWidth;
  Vec acc[kPadded];
#pragma GCC unroll 16
  for (int i = 0; i < kPadded; ++i) acc[i] = Isa::zero();
  for (int c = 0; c < num_chunks; c += kStep) {
#pragma GCC unroll 2
    for (int s = 0; s < kStep; ++s) {
      Vec k[kTokens];
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) {
        const Kv* row = keys + t * head_dim;
        k[t] = s == 0 ? R::template load<0>(row, c) : R::template load<1>(row, c + 1);
      }
#pragma GCC unroll 8
      for (int h = 0; h < kHeads; ++h) {
        Vec qv = Isa::load(q + h * head_dim + (c + s) * kWidth);
        // Left alone, GCC folds this load into each of the kTokens fmas that
        // use qv; the loads then outnumber the fmas and bound the loop (~12%
        // slower on Zen 3). Pinned, it is loaded once.
        if constexpr (kTokens > 1) Isa::pin(qv);
#pragma GCC unroll 8
        for (int t = 0; t < kTokens; ++t) acc[h * kTokens + t] = Isa::fma(qv, k[t], acc[h * kTokens + t]);
      }
    }
  }
  float sums[kPadded];
#pragma GCC unroll 2
  for (int i = 0; i < kPadded; i += kReduceWidth) {
    Isa::reduce8(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], acc[i + 4], acc[i + 5], acc[i + 6],
                 acc[i + 7], sums + i);
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) scores[h * score_stride + t] = sums[h * kTokens + t];
  }
}

// Scores of kHeads query rows against all num_tokens keys of a block. When
// next_keys is set, the same rows of the next unit's keys are prefetched as
// these are scored, half a tile's rows before the tile and half after, so the
// requests are spread over the work instead of flooding the miss buffers at
// once (the next unit's values are prefetched alike by value_heads).
template <class Kv, bool kSplit, int kHeads>
inline void score_heads(const float* q, const Kv* keys, int head_dim, int num_tokens,
                        float* scores, int score_stride, const Kv* next_keys) {
  constexpr int kTokens = kTile / kHeads < kMaxTileTokens ? kTile / kHeads : kMaxTileTokens;
  constexpr int kEarlyRows = (kTokens + 1) / 2;
  const size_t row_bytes = head_dim * sizeof(Kv);
  int t = 0;
  for (; t + kTokens <= num_tokens; t += kTokens) {
    if (next_keys != nullptr) prefetch_lines(next_keys + t * head_dim, kEarlyRows * row_bytes);
    score_tile<Kv, kSplit, kHeads, kTokens>(q, keys + t * head_dim, head_dim, scores + t, score_stride);
    if (next_keys != nullptr && kTokens > kEarlyRows) {
      prefetch_lines(next_keys + (t + kEarlyRows) * head_dim, (kTokens - kEarlyRows) * row_bytes);
    }
  }
  for (; t < num_tokens; ++t) {
    if (next_keys != nullptr) prefetch_lines(next_keys + t * head_dim, row_bytes);
    score_tile<Kv, kSplit, kHeads, 1>(q, keys + t * head_dim, head_dim, scores + t, score_stride);
  }
}

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

template <class Kv, bool kSplit>
inline void score_block(const float* q, const Kv* keys, int group_size, int head_dim,
                        int num_tokens, float* scores, int score_stride, const Kv* next_keys) {
  for (int h = 0; h < group_size; h += kMaxTileHeads) {
    const float* qh = q + h * head_dim;
    float* sh = scores + h * score_stride;
    if (h > 0) next_keys = nullptr;  // prefetched during the first pass over the keys
    with_tile_heads(group_size - h, [&](auto heads) {
      score_heads<Kv, kSplit, decltype(heads)::value>(qh, keys, head_dim, num_tokens, sh, score_stride, next_keys);
    });
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

// A tile's share [tile * lines / tiles, (tile + 1) * lines / tiles) of the
// cache lines of `rows` rows starting at `start`.
template <class Kv>
inline void prefetch_share(const Kv* start, int rows, int head_dim, int tile, int tiles) {
  const size_t lines = (static_cast<size_t>(rows) * head_dim * sizeof(Kv) + kCacheLine - 1) / kCacheLine;
  const size_t first = tile * lines / tiles;
  prefetch_lines(reinterpret_cast<const char*>(start) + first * kCacheLine,
                 ((tile + 1) * lines / tiles - first) * kCacheLine);
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
  int c = 0;
  for (int tile = 0; c < num_chunks; ++tile) {
    if (next_values != nullptr) prefetch_share(next_values, num_tokens, head_dim, tile, num_tiles);
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
// summed once at the end rather than by a horizontal reduction per block.
inline void softmax_update(float* scores, int score_stride, int group_size, int head_dim,
                           float* run_max, float* sum_lanes, float* acc) {
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
  float* q;          // [group_size, head_dim], pre-scaled (split order when kSplit)
  float* acc;        // [group_size, head_dim]
  float* run_max;    // [group_size]
  float* sum_lanes;  // [group_size, kWidth]
};

inline HeadState head_state(const Problem& p, float* heads, int kv_head) {
  const int g = p.group_size();
  float* base = heads + kv_head * head_state_floats(p);
  float* acc = base + g * p.head_dim;
  float* run_max = acc + g * p.head_dim;
  return HeadState{base, acc, run_max, run_max + g};
}

template <bool kSplit>
void start_head(const Problem& p, int seq, int kv_head, const HeadState& state) {
  const int group_size = p.group_size();
  const size_t first_row = static_cast<size_t>(seq) * p.num_heads + kv_head * group_size;
  load_row(p.query, p.query_dtype, first_row * p.head_dim, group_size * p.head_dim, p.scale, state.q);
  if (kSplit) to_split_order(state.q, group_size, p.head_dim);
  for (int i = 0; i < group_size * p.head_dim; ++i) state.acc[i] = 0.0f;
  for (int h = 0; h < group_size; ++h) {
    state.run_max[h] = -__builtin_inff();
    Isa::store(state.sum_lanes + h * kWidth, Isa::zero());
  }
}

// Writes a finished head to problem.out, or its partial state to `partial`.
template <bool kSplit>
void finish_head(const Problem& p, int seq, int kv_head, const HeadState& state, const PartialState* partial) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  if (kSplit) from_split_order(state.acc, group_size, head_dim);
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

// Walks the segment's units in order: every covered kv head of a block, then
// the next block. Each head keeps its own running state; the scores buffer is
// shared, as one (block, head) unit is finished before the next starts.
template <class Kv, bool kSplit>
void attend_segment_typed(const Problem& p, const Segment& seg, float* scratch,
                          const PartialState* partials) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  const int block_size = p.block_size;
  const int num_kv_heads = p.num_kv_heads;
  const int score_stride = static_cast<int>(score_stride_floats(p));
  float* scores = scratch;  // [group_size, score_stride]
  float* heads = scores + group_size * score_stride;

  for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    if (!head_blocks(seg, kv_head, num_kv_heads).empty()) {
      start_head<kSplit>(p, seg.seq, kv_head, head_state(p, heads, kv_head));
    }
  }

  const Kv* key_cache = static_cast<const Kv*>(p.key_cache);
  const Kv* value_cache = static_cast<const Kv*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<size_t>(seg.seq) * p.max_blocks_per_seq;
  const int context_len = p.context_lens[seg.seq];
  const size_t head_elems = static_cast<size_t>(block_size) * head_dim;
  const size_t block_elems = head_elems * num_kv_heads;

  // Element offset of a unit's rows in either cache.
  const auto unit_offset = [&](int64_t unit) {
    return static_cast<size_t>(table[unit / num_kv_heads]) * block_elems + (unit % num_kv_heads) * head_elems;
  };

  for (int64_t unit = seg.unit_begin; unit < seg.unit_end; ++unit) {
    const int b = static_cast<int>(unit / num_kv_heads);
    const HeadState state = head_state(p, heads, static_cast<int>(unit % num_kv_heads));
    const size_t base = unit_offset(unit);
    const int num_tokens = min_int(block_size, context_len - b * block_size);
    // The next unit's rows are prefetched while this one is worked on: past a
    // block's last head they are anywhere in the pool, out of the hardware
    // prefetchers' reach, and within a block the prefetchers alone fall behind.
    const bool has_next = unit + 1 < seg.unit_end;
    const Kv* next_keys = has_next ? key_cache + unit_offset(unit + 1) : nullptr;
    const Kv* next_values = has_next ? value_cache + unit_offset(unit + 1) : nullptr;
    for (int h = 0; h < group_size; ++h) {
      for (int t = num_tokens; t < score_stride; ++t) scores[h * score_stride + t] = -__builtin_inff();
    }
    score_block<Kv, kSplit>(state.q, key_cache + base, group_size, head_dim, num_tokens, scores, score_stride,
                            next_keys);
    touch_lines(value_cache + base, static_cast<size_t>(num_tokens) * head_dim * sizeof(Kv));
    softmax_update(scores, score_stride, group_size, head_dim, state.run_max, state.sum_lanes, state.acc);
    accumulate_block<Kv, kSplit>(scores, score_stride, value_cache + base, group_size, head_dim, num_tokens,
                                 state.acc, next_values);
  }

  const int num_blocks = num_logical_blocks(context_len, block_size);
  for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    const BlockRange range = head_blocks(seg, kv_head, num_kv_heads);
    if (range.empty()) continue;
    finish_head<kSplit>(p, seg.seq, kv_head, head_state(p, heads, kv_head),
                        range.whole(num_blocks) ? nullptr : &partials[kv_head]);
  }
}

void attend_segment(const Problem& p, const Segment& seg, float* scratch,
                    const PartialState* partials) {
  switch (p.kv_dtype) {
    case DType::kFloat32: attend_segment_typed<float, false>(p, seg, scratch, partials); break;
    case DType::kBFloat16:
      if (HasSplitLoads<Isa>::value && p.head_dim % (2 * kWidth) == 0) {
        attend_segment_typed<BFloat16, HasSplitLoads<Isa>::value>(p, seg, scratch, partials);
      } else {
        attend_segment_typed<BFloat16, false>(p, seg, scratch, partials);
      }
      break;
    default: attend_segment_typed<Float16, false>(p, seg, scratch, partials); break;
  }
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
