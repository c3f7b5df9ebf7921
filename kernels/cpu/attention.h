// Shared declarations of the CPU paged decode-attention kernel.
//
// The work is cut flash-decoding style: the batch's (sequence, kv head, block)
// units are split evenly over threads, so a thread may own only part of one
// sequence's blocks. Such a "segment" leaves a partial softmax state (running
// max, running sum, unnormalised accumulator) that is merged afterwards by
// log-sum-exp; a segment that covers a whole sequence writes the output directly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

// head_dim must be a multiple of the widest vector (16 fp32 lanes) and at most
// kMaxHeadDim, which bounds a stack buffer in the merge.
constexpr int kHeadDimMultiple = 16;
constexpr int kMaxHeadDim = 1024;

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Distinct 16-bit storage types so overloads pick the right conversion.
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

// One decode-attention call. All tensors are contiguous.
struct Problem {
  const void* query;          // [batch, num_heads, head_dim], query_dtype
  void* out;                  // [batch, num_heads, head_dim], query_dtype
  DType query_dtype;
  const void* key_cache;      // [num_blocks, num_kv_heads, block_size, head_dim], kv_dtype
  const void* value_cache;    // same shape and dtype as key_cache
  DType kv_dtype;
  const int32_t* block_tables;  // [batch, max_blocks_per_seq]
  const int32_t* context_lens;  // [batch], including the token being decoded
  int64_t num_blocks;
  int batch;
  int max_blocks_per_seq;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  float scale;

  int group_size() const { return num_heads / num_kv_heads; }
};

// A contiguous run of logical blocks of one (sequence, kv head).
struct Segment {
  int seq;
  int kv_head;
  int block_begin;
  int block_end;
};

// Softmax state of one segment for the group_size query heads of its kv head.
struct PartialState {
  float* max;  // [group_size]
  float* sum;  // [group_size]
  float* acc;  // [group_size, head_dim], not yet divided by sum
};

// Floats of per-thread scratch one segment needs.
inline size_t segment_scratch_floats(const Problem& p) {
  const size_t g = static_cast<size_t>(p.group_size());
  const size_t score_stride = (static_cast<size_t>(p.block_size) + kHeadDimMultiple - 1) /
                              kHeadDimMultiple * kHeadDimMultiple;
  // query copy + accumulator, block scores, running max, running sum lanes
  return 2 * g * p.head_dim + g * score_stride + g + g * kHeadDimMultiple;
}

// Entry points one instruction set provides.
struct KernelTable {
  const char* name;
  // Attends one segment. With partial == nullptr the segment covers the whole
  // sequence and the normalised result goes to problem.out.
  void (*attend_segment)(const Problem& problem, const Segment& segment, float* scratch,
                         const PartialState* partial);
  // Merges num_parts partial states of one (seq, kv_head) into problem.out.
  void (*merge_partials)(const Problem& problem, int seq, int kv_head, const PartialState* parts,
                         int num_parts);
};

// Constants of the vector e^x every SIMD path uses: x = n ln 2 + r, e^x = 2^n e^r, with e^r from
// a degree-6 Taylor polynomial. Each ISA's `Isa` struct derives from this.
struct ExpConstants {
  static constexpr float kExpMin = -87.33654f;  // below: e^x is not a normal fp32
  static constexpr float kExpMax = 88.0f;        // keeps 2^n below the exponent limit
  static constexpr float kLog2e = 1.44269504f;
  static constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so n * kLn2Hi is exact
  static constexpr float kLn2Lo = -2.12194440e-4f;
  static constexpr float kExpC2 = 1.0f / 2.0f;
  static constexpr float kExpC3 = 1.0f / 6.0f;
  static constexpr float kExpC4 = 1.0f / 24.0f;
  static constexpr float kExpC5 = 1.0f / 120.0f;
  static constexpr float kExpC6 = 1.0f / 720.0f;
};

// Each returns nullptr when the instruction set was not compiled in.
const KernelTable* avx512_kernels();
const KernelTable* avx2_kernels();
const KernelTable* neon_kernels();
const KernelTable* scalar_kernels();

}  // namespace tandem
