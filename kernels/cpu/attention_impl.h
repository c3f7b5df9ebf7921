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

#include "attention.h"

namespace tandem {
namespace {

using Vec = Isa::Vec;
constexpr int kWidth = Isa::kWidth;
// Register tiles hold at most this many accumulators (the traits' reduce8 width).
constexpr int kTile = 8;

// The tile functions must inline into their loops: as calls, the accumulator
// arrays would go through the stack.
#define TANDEM_ALWAYS_INLINE __attribute__((always_inline)) inline

inline int min_int(int a, int b) { return a < b ? a : b; }
inline float max_float(float a, float b) { return a > b ? a : b; }
inline int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

constexpr size_t kCacheLine = 64;

inline void prefetch_lines(const void* start, size_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (size_t offset = 0; offset < bytes; offset += kCacheLine) Isa::prefetch(p + offset);
}

// Where the block after the current one lives, for prefetching.
template <class Kv>
struct NextBlock {
  const Kv* keys;
  const Kv* values;
};

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
template <class Kv, int kHeads, int kTokens>
TANDEM_ALWAYS_INLINE void score_tile(const float* q, const Kv* keys, int head_dim, float* scores,
                       int score_stride) {
  static_assert(kHeads * kTokens <= kTile, "tile exceeds the register budget");
  Vec acc[kTile];
#pragma GCC unroll 8
  for (int i = 0; i < kTile; ++i) acc[i] = Isa::zero();
  for (int c = 0; c < head_dim; c += kWidth) {
    Vec k[kTokens];
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) k[t] = Isa::load(keys + t * head_dim + c);
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const Vec qv = Isa::load(q + h * head_dim + c);
#pragma GCC unroll 8
      for (int t = 0; t < kTokens; ++t) acc[h * kTokens + t] = Isa::fma(qv, k[t], acc[h * kTokens + t]);
    }
  }
  float sums[kTile];
  Isa::reduce8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], sums);
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 8
    for (int t = 0; t < kTokens; ++t) scores[h * score_stride + t] = sums[h * kTokens + t];
  }
}

// Scores of kHeads query rows against all num_tokens keys of a block.
// Scores of kHeads query rows against all num_tokens keys of a block. When
// `next` is set, the rows of the next block (its K and V) are prefetched as
// the same rows of this one are scored, so the requests are spread over the
// block's work instead of flooding the miss buffers at once.
template <class Kv, int kHeads>
inline void score_heads(const float* q, const Kv* keys, int head_dim, int num_tokens,
                        float* scores, int score_stride, const NextBlock<Kv>* next) {
  constexpr int kTokens = kTile / kHeads;
  const size_t row_bytes = head_dim * sizeof(Kv);
  int t = 0;
  for (; t + kTokens <= num_tokens; t += kTokens) {
    if (next != nullptr) {
      prefetch_lines(next->keys + t * head_dim, kTokens * row_bytes);
      prefetch_lines(next->values + t * head_dim, kTokens * row_bytes);
    }
    score_tile<Kv, kHeads, kTokens>(q, keys + t * head_dim, head_dim, scores + t, score_stride);
  }
  for (; t < num_tokens; ++t) {
    if (next != nullptr) {
      prefetch_lines(next->keys + t * head_dim, row_bytes);
      prefetch_lines(next->values + t * head_dim, row_bytes);
    }
    score_tile<Kv, kHeads, 1>(q, keys + t * head_dim, head_dim, scores + t, score_stride);
  }
}

template <class Kv>
inline void score_block(const float* q, const Kv* keys, int group_size, int head_dim,
                        int num_tokens, float* scores, int score_stride, const NextBlock<Kv>* next) {
  for (int h = 0; h < group_size; h += kTile) {
    const float* qh = q + h * head_dim;
    float* sh = scores + h * score_stride;
    if (h > 0) next = nullptr;  // prefetched during the first pass over the keys
    switch (min_int(group_size - h, kTile)) {
      case 1: score_heads<Kv, 1>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 2: score_heads<Kv, 2>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 3: score_heads<Kv, 3>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 4: score_heads<Kv, 4>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 5: score_heads<Kv, 5>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 6: score_heads<Kv, 6>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      case 7: score_heads<Kv, 7>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
      default: score_heads<Kv, 8>(qh, keys, head_dim, num_tokens, sh, score_stride, next); break;
    }
  }
}

// acc[h, c..c+kChunks*kWidth) += sum_t probs[h, t] * values[t, same columns].
// kHeads * kChunks independent accumulators keep the fma pipes busy even for
// one head (no GQA).
template <class Kv, int kHeads, int kChunks>
TANDEM_ALWAYS_INLINE void value_tile(const float* probs, int prob_stride, const Kv* values, int head_dim,
                       int num_tokens, float* acc) {
  static_assert(kHeads * kChunks <= kTile, "tile exceeds the register budget");
  Vec a[kHeads * kChunks];
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < kChunks; ++j) a[h * kChunks + j] = Isa::load(acc + h * head_dim + j * kWidth);
  }
  for (int t = 0; t < num_tokens; ++t) {
    Vec v[kChunks];
#pragma GCC unroll 8
    for (int j = 0; j < kChunks; ++j) v[j] = Isa::load(values + t * head_dim + j * kWidth);
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      const Vec p = Isa::set1(probs[h * prob_stride + t]);
#pragma GCC unroll 8
      for (int j = 0; j < kChunks; ++j) a[h * kChunks + j] = Isa::fma(p, v[j], a[h * kChunks + j]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
#pragma GCC unroll 8
    for (int j = 0; j < kChunks; ++j) Isa::store(acc + h * head_dim + j * kWidth, a[h * kChunks + j]);
  }
}

template <class Kv, int kHeads>
inline void value_heads(const float* probs, int prob_stride, const Kv* values, int head_dim,
                        int num_tokens, float* acc) {
  constexpr int kChunks = kTile / kHeads;
  const int num_chunks = head_dim / kWidth;
  int c = 0;
  for (; c + kChunks <= num_chunks; c += kChunks) {
    value_tile<Kv, kHeads, kChunks>(probs, prob_stride, values + c * kWidth, head_dim, num_tokens,
                                    acc + c * kWidth);
  }
  for (; c < num_chunks; ++c) {
    value_tile<Kv, kHeads, 1>(probs, prob_stride, values + c * kWidth, head_dim, num_tokens,
                              acc + c * kWidth);
  }
}

template <class Kv>
inline void accumulate_block(const float* probs, int prob_stride, const Kv* values,
                             int group_size, int head_dim, int num_tokens, float* acc) {
  for (int h = 0; h < group_size; h += kTile) {
    const float* ph = probs + h * prob_stride;
    float* ah = acc + h * head_dim;
    switch (min_int(group_size - h, kTile)) {
      case 1: value_heads<Kv, 1>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 2: value_heads<Kv, 2>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 3: value_heads<Kv, 3>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 4: value_heads<Kv, 4>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 5: value_heads<Kv, 5>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 6: value_heads<Kv, 6>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      case 7: value_heads<Kv, 7>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
      default: value_heads<Kv, 8>(ph, prob_stride, values, head_dim, num_tokens, ah); break;
    }
  }
}

// Online softmax step for one block: turns scores into probabilities relative
// to the updated running max and rescales the accumulator when the max grew.
// Padding columns [num_tokens, score_stride) hold -inf and come out as 0.
inline void softmax_update(float* scores, int score_stride, int group_size, int head_dim,
                           float* run_max, float* run_sum, float* acc) {
  for (int h = 0; h < group_size; ++h) {
    float* s = scores + h * score_stride;
    Vec m = Isa::set1(run_max[h]);
    for (int t = 0; t < score_stride; t += kWidth) m = Isa::max(m, Isa::load(s + t));
    const float new_max = Isa::reduce_max(m);
    if (new_max > run_max[h]) {
      const float correction = Isa::exp_scalar(run_max[h] - new_max);
      run_sum[h] *= correction;
      const Vec cv = Isa::set1(correction);
      float* a = acc + h * head_dim;
      for (int c = 0; c < head_dim; c += kWidth) Isa::store(a + c, Isa::mul(Isa::load(a + c), cv));
      run_max[h] = new_max;
    }
    const Vec mv = Isa::set1(run_max[h]);
    Vec sum = Isa::zero();
    for (int t = 0; t < score_stride; t += kWidth) {
      const Vec p = Isa::exp(Isa::sub(Isa::load(s + t), mv));
      Isa::store(s + t, p);
      sum = Isa::add(sum, p);
    }
    run_sum[h] += Isa::reduce_add(sum);
  }
}

template <class Kv>
void attend_segment_typed(const Problem& p, const Segment& seg, float* scratch,
                          const PartialState* partial) {
  const int group_size = p.group_size();
  const int head_dim = p.head_dim;
  const int block_size = p.block_size;
  const int score_stride = round_up(block_size, kWidth);

  float* q = scratch;                              // [group_size, head_dim], pre-scaled
  float* acc = q + group_size * head_dim;          // [group_size, head_dim]
  float* scores = acc + group_size * head_dim;     // [group_size, score_stride]
  float* run_max = scores + group_size * score_stride;  // [group_size]
  float* run_sum = run_max + group_size;                // [group_size]

  const size_t first_row = static_cast<size_t>(seg.seq) * p.num_heads + seg.kv_head * group_size;
  load_row(p.query, p.query_dtype, first_row * head_dim, group_size * head_dim, p.scale, q);
  for (int i = 0; i < group_size * head_dim; ++i) acc[i] = 0.0f;
  for (int h = 0; h < group_size; ++h) {
    run_max[h] = -__builtin_inff();
    run_sum[h] = 0.0f;
  }

  const Kv* key_cache = static_cast<const Kv*>(p.key_cache);
  const Kv* value_cache = static_cast<const Kv*>(p.value_cache);
  const int32_t* table = p.block_tables + static_cast<size_t>(seg.seq) * p.max_blocks_per_seq;
  const int context_len = p.context_lens[seg.seq];
  const size_t head_elems = static_cast<size_t>(block_size) * head_dim;
  const size_t block_elems = head_elems * p.num_kv_heads;

  for (int b = seg.block_begin; b < seg.block_end; ++b) {
    const size_t base = static_cast<size_t>(table[b]) * block_elems + seg.kv_head * head_elems;
    const int num_tokens = min_int(block_size, context_len - b * block_size);
    // The next physical block is anywhere in the pool, out of the hardware
    // prefetchers' reach: fetch it while this one is worked on.
    NextBlock<Kv> next{nullptr, nullptr};
    if (b + 1 < seg.block_end) {
      const size_t next_base = static_cast<size_t>(table[b + 1]) * block_elems + seg.kv_head * head_elems;
      next = NextBlock<Kv>{key_cache + next_base, value_cache + next_base};
    }
    for (int h = 0; h < group_size; ++h) {
      for (int t = num_tokens; t < score_stride; ++t) scores[h * score_stride + t] = -__builtin_inff();
    }
    score_block(q, key_cache + base, group_size, head_dim, num_tokens, scores, score_stride,
                b + 1 < seg.block_end ? &next : nullptr);
    softmax_update(scores, score_stride, group_size, head_dim, run_max, run_sum, acc);
    accumulate_block(scores, score_stride, value_cache + base, group_size, head_dim, num_tokens, acc);
  }

  if (partial != nullptr) {
    for (int h = 0; h < group_size; ++h) {
      partial->max[h] = run_max[h];
      partial->sum[h] = run_sum[h];
    }
    for (int i = 0; i < group_size * head_dim; ++i) partial->acc[i] = acc[i];
    return;
  }
  for (int h = 0; h < group_size; ++h) {
    store_row(acc + h * head_dim, 1.0f / run_sum[h], head_dim, p.out, p.query_dtype,
              (first_row + h) * head_dim);
  }
}

void attend_segment(const Problem& p, const Segment& seg, float* scratch,
                    const PartialState* partial) {
  switch (p.kv_dtype) {
    case DType::kFloat32: attend_segment_typed<float>(p, seg, scratch, partial); break;
    case DType::kBFloat16: attend_segment_typed<BFloat16>(p, seg, scratch, partial); break;
    default: attend_segment_typed<Float16>(p, seg, scratch, partial); break;
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
