// Shared declarations of the CPU paged decode-attention kernel.
//
// The work is cut flash-decoding style. A sequence's work units are its
// (logical block, kv head) pairs, numbered block-major: unit = block *
// num_kv_heads + kv_head. In the pool layout the kv heads of one block are
// adjacent, so walking units in order reads each physical block's K (and V) as
// one contiguous run; on random block placement that reads far faster than
// visiting one head's slice of every block in turn (about 1.7x for a 2-core
// pure reader on 32 KiB runs against 4 KiB ones). The batch's units are split
// evenly over threads, and a thread that runs out takes half of what another has
// left (bindings.cpp), so a thread may attend only part of a sequence: a
// segment. A head whose blocks are split leaves a partial softmax state (running
// max, running sum, unnormalised accumulator) that is merged afterwards by
// log-sum-exp; a head attended over all its blocks writes the output directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "dtypes.h"
#include "int4.h"
#include "kv_quant.h"

namespace tandem {

// head_dim must be a multiple of the widest vector (16 fp32 lanes) and at most
// kMaxHeadDim, which bounds a stack buffer in the merge.
constexpr int kHeadDimMultiple = 16;
constexpr int kMaxHeadDim = 1024;

// One decode-attention call. All tensors are contiguous.
struct Problem {
  const void* query;          // [batch, num_heads, head_dim], query_dtype
  void* out;                  // [batch, num_heads, head_dim], query_dtype
  DType query_dtype;
  const void* key_cache;      // [num_blocks, num_kv_heads, head_dim, block_size], kv_dtype
  const void* value_cache;    // [num_blocks, num_kv_heads, block_size, head_dim], kv_dtype
  DType kv_dtype;             // or kInt8/kInt4/kK8V4: caches [num_blocks, num_kv_heads, their KvUnit's bytes]
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

inline int num_logical_blocks(int context_len, int block_size) {
  return (context_len + block_size - 1) / block_size;
}

// A contiguous run [unit_begin, unit_end) of one sequence's block-major units.
struct Segment {
  int seq;
  int64_t unit_begin;
  int64_t unit_end;
};

// The logical blocks [begin, end) of one kv head that a segment covers.
struct BlockRange {
  int begin;
  int end;
  bool empty() const { return begin >= end; }
  // All num_blocks of the sequence: the head's result is final, not a partial state.
  bool whole(int num_blocks) const { return begin == 0 && end == num_blocks; }
};

// Block b belongs to kv head h's range when unit_begin <= b * H + h < unit_end.
inline int first_block_from(int64_t unit, int kv_head, int num_kv_heads) {
  return unit <= kv_head ? 0 : static_cast<int>((unit - kv_head + num_kv_heads - 1) / num_kv_heads);
}

inline BlockRange head_blocks(const Segment& segment, int kv_head, int num_kv_heads) {
  return BlockRange{first_block_from(segment.unit_begin, kv_head, num_kv_heads),
                    first_block_from(segment.unit_end, kv_head, num_kv_heads)};
}

// Softmax state of one segment for the group_size query heads of one kv head.
struct PartialState {
  float* max;  // [group_size]
  float* sum;  // [group_size]
  float* acc;  // [group_size, head_dim], not yet divided by sum
};

// Floats of one kv head's partial state, laid out max, sum, acc.
inline size_t partial_state_floats(const Problem& p) {
  return static_cast<size_t>(p.group_size()) * (p.head_dim + 2);
}

// kv_head's state in a slot holding num_kv_heads partial states back to back.
inline PartialState partial_state(const Problem& p, float* slot, int kv_head) {
  float* base = slot + kv_head * partial_state_floats(p);
  return PartialState{base, base + p.group_size(), base + 2 * p.group_size()};
}

// Block scores' row stride: block_size rounded up to the widest vector.
inline size_t score_stride_floats(const Problem& p) {
  return (static_cast<size_t>(p.block_size) + kHeadDimMultiple - 1) / kHeadDimMultiple * kHeadDimMultiple;
}

// Quantization groups of a head (0 where head_dim is below one group: a dense cache).
inline size_t quant_groups(const Problem& p) { return static_cast<size_t>(p.head_dim) / kQuantGroup; }

// Floats of one kv head's running state: query copy + accumulator, running max, running sum lanes,
// the query's sums over each quantization group (the INT4 keys' min term), the INT4 values'
// running sums of probability times min, as lanes per group, and the query as int8 codes with a
// step and a code sum per group (where keys are scored by integer dot products).
inline size_t head_state_floats(const Problem& p) {
  const size_t g = static_cast<size_t>(p.group_size());
  const size_t query_code_floats = g * p.head_dim / sizeof(float) + 2 * g * quant_groups(p);
  return 2 * g * p.head_dim + g + g * kHeadDimMultiple + g * quant_groups(p) * (1 + kHeadDimMultiple) +
         query_code_floats;
}

// Floats of a quantized unit's value coefficients, probability times scale: [num_groups,
// group_size, score_stride]; none for a dense cache.
inline size_t value_coefficient_floats(const Problem& p) {
  return is_quantized(p.kv_dtype) ? quant_groups(p) * p.group_size() * score_stride_floats(p) : 0;
}

// Floats per key row of the tail tile: one token span (at most 16 fp32 or 32 bf16 tokens).
constexpr int kTailRowFloats = 16;

// Floats of per-thread scratch one segment needs: the block scores, every kv head's state, the
// tail tile that holds a partial token span of key columns ([head_dim, kTailRowFloats]), then the
// value coefficients of a quantized unit.
inline size_t segment_scratch_floats(const Problem& p) {
  return static_cast<size_t>(p.group_size()) * score_stride_floats(p) + p.num_kv_heads * head_state_floats(p) +
         static_cast<size_t>(p.head_dim) * kTailRowFloats + value_coefficient_floats(p);
}

// Entry points one instruction set provides.
struct KernelTable {
  const char* name;
  // Attends the units [piece.unit_begin, piece.unit_end) of sequence piece.seq,
  // continuing the segment that began at unit segment_begin <= piece.unit_begin:
  // consecutive pieces of one segment go to the same thread's scratch, in order,
  // and a kv head's running state is started at its first unit in the segment.
  // Units before prefetch_end may be prefetched (a hint: they need not be attended).
  void (*attend_units)(const Problem& problem, const Segment& piece, int64_t segment_begin,
                       int64_t prefetch_end, float* scratch);
  // Ends a segment whose units have all been attended into scratch. A kv head
  // whose blocks the segment covers entirely writes its normalised result to
  // problem.out; one it covers only in part leaves its state in
  // partial_state(problem, partials, kv_head) (partials may be nullptr when
  // every covered head is whole).
  void (*finish_segment)(const Problem& problem, const Segment& segment, float* scratch, float* partials);
  // Merges num_parts partial states of one (seq, kv_head) into problem.out.
  void (*merge_partials)(const Problem& problem, int seq, int kv_head, const PartialState* parts,
                         int num_parts);
  // The INT4 matmul's output tiles [tile_begin, tile_end) of 16 columns, for the whole batch (int4.h).
  void (*int4_tiles)(const Int4Problem& problem, int tile_begin, int tile_end);
  // Rows [row_begin, row_end) of the activations quantized to int16 for int4_tiles.
  void (*int4_quantize_rows)(const Int4Activations& activations, int row_begin, int row_end);
  // The INT4 matmul over int8 activations, one thread's output tiles and x rows (int4_q8_impl.h).
  void (*int4_q8_tiles)(const Int4Q8Problem& problem, const Int4Q8Range& range);
  // Rows [row_begin, row_end) of the activations quantized to int8 for int4_q8_tiles.
  void (*int4_q8_quantize_rows)(const Int4Q8Activations& activations, int row_begin, int row_end);
  // Rows [row_begin, row_end) of the INT4 weight, dense in `dtype`, into out (from its first row).
  void (*int4_dequantize)(const Int4Problem& problem, void* out, DType dtype, int row_begin, int row_end);
  // RMSNorm of rows x [rows, hidden] into out, in `dtype` (rms_norm_impl.h).
  void (*rms_norm_rows)(const void* x, const void* weight, void* out, DType dtype, int rows, int hidden, float eps);
  // Rotary embedding of x [tokens, heads, head_dim] into out at each token's position (rope_impl.h).
  void (*rope_rows)(const void* x, void* out, DType dtype, const int64_t* positions, const float* cos,
                    const float* sin, int tokens, int heads, int head_dim);
  // Output columns [col_begin, col_end) of a few rows of x times a dense W^T (gemv_impl.h).
  void (*gemv_cols)(const GemvProblem& problem, int col_begin, int col_end);
  // Elementwise (elementwise_impl.h), counts a multiple of 16: out = a + b row by row (b one row
  // broadcast over a's when b_rows is 1), rounded to the dtype.
  void (*add_rows)(const void* a, const void* b, void* out, DType dtype, int rows, int cols, int b_rows);
  // gate_up [rows, 2 * width] -> out [rows, width] = to_dtype(to_dtype(silu(gate)) * up), SwiGLU's glue.
  void (*silu_mul_rows)(const void* gate_up, void* out, DType dtype, int rows, int width);
  // count elements from one dtype to another (rounded to nearest even).
  void (*convert)(const void* x, DType from, void* out, DType to, size_t count);
  // Whether quantized keys are scored by integer dot products, the query quantized to int8 per
  // group (kernels/kv_quant.py: query_round_trip); else in fp32 with the codes widened.
  bool integer_dots;
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
const KernelTable* avx512_vnni_kernels();
const KernelTable* avx512_kernels();
const KernelTable* avx2_kernels();
const KernelTable* neon_dotprod_kernels();
const KernelTable* neon_kernels();
const KernelTable* scalar_kernels();

}  // namespace tandem
