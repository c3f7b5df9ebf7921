// Group-wise 4-bit weights and the matmul over them: y = x @ W^T.
//
// Canonical layout (kernels/cpu/int4.py; what loaders produce and the GPU kernel reads): W [n, k] as
//   qweight [n, k / 2] uint8: every run of 32 weights along k is 16 bytes, byte i holding weight i
//     in its low nibble and weight i + 16 in its high nibble (GGUF Q4_0/Q4_1's own order);
//   scales, mins [n, k / group_size] fp32: weight = scale * q + min, q in [0, 15].
//
// The CPU kernel reads a tiled copy, made once at load by a byte permutation (int4.py `tile`):
//   codes: for each tile of kInt4TileRows = 16 output rows and each 32-weight block along k,
//     kInt4Chunks = 4 chunks of 64 bytes; chunk i holds, for each of the tile's 16 rows in turn,
//     that row's canonical bytes 4i .. 4i + 3 of the block. Its low nibbles are weights 4i .. 4i + 3
//     of 16 rows, its high nibbles weights 16 + 4i .. 16 + 4i + 3: widened to int16, 4 weights of
//     8 rows fill one 512-bit vector whose pairs vpmaddwd (AVX-512 VNNI: vpdpwssd) multiplies with
//     4 activations broadcast to every row, leaving each row's sums in its own two lanes (one
//     permute per block turns them into 16 lanes = 16 output columns: no horizontal sums);
//   scales, mins [tiles, k / group_size, 16] fp32. Rows past n in the last tile are zero.
//
// Activations are quantized per row and 32-weight block, in one of two formats (int4.py
// `activation_bits`):
// - int8 (llama.cpp's Q8_0 blocks: scale = max |x| / 127, round to nearest), for prefill. The
//   codes stay bytes: chunk i masked to its low nibbles (or shifted to its high ones) is 16 rows x 4
//   unsigned codes, and 4 activations broadcast as one int32 meet every row at once, 4 products
//   per lane, each row's sum in its own lane: vpdpbusd (u8 x s8, AVX-512 VNNI), vpmaddubsw +
//   vpmaddwd (AVX2, AVX-512), sdot (NEON dotprod). A row block shares each unpacked chunk
//   (int4_q8_impl.h), so prefill's many rows read the weight from cache rather than memory.
// - int16 (scale = max |x| / 32767): codes widened to int16, 4 weights of 8 rows fill one 512-bit
//   vector whose pairs vpmaddwd (vpdpwssd) multiplies with 4 activations broadcast to every row,
//   leaving each row's sums in its own two lanes (one permute per block gives 16 output columns).
//   About 1e-4 of relative error, for decode: memory-bound there, it costs no time.
// The codes act centered, q - 8, so the activations' rounding meets weights half the size of q's:
// with x' = x_scale * x_int,
//   y = sum over groups of scale * (<q, x'> - 8 sum(x')) + (min + 8 scale) * sum(x),
// the last sum over the exact fp32 x. On the embedded model's held text, int8 against int16 moves
// perplexity by -0.04% but top-1 agreement to 95.8% (near-tied logits flip), which is why the
// engine keeps int16 for decode-sized batches (engine/quant/int4.py MAX_INT16_ROWS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

namespace tandem {

constexpr int kInt4Block = 32;     // weights per block along k; group_size is a multiple of it
constexpr int kInt4TileRows = 16;  // output rows interleaved in one tile
constexpr int kInt4Chunks = 4;     // 64-byte chunks per tile and block
constexpr int kInt4ChunkBytes = kInt4TileRows * 4;
constexpr int kInt4TileBlockBytes = kInt4Chunks * kInt4ChunkBytes;  // = 16 rows x 16 bytes
constexpr int kInt4MaxQuant = 32767;  // int16 activations in [-32767, 32767]
constexpr int kInt4MaxQuant8 = 127;   // int8 activations in [-127, 127]
constexpr int kInt4CodeCenter = 8;  // codes 0..15 act as q - 8

// 4 int16 activations as one int64, to broadcast to every row of a dot product.
inline int64_t load_i64(const int16_t* p) {
  int64_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// 4 int8 activations as one int32, to broadcast to every row of a dot product.
inline int32_t load_i32(const int8_t* p) {
  int32_t value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// The tiled weight, the output and the shape: what the int16 and int8 matmuls share.
struct Int4Matmul {
  const uint8_t* codes;  // tiled, [tiles, k / 32, 4, 16, 4]
  const float* scales;   // [tiles, k / group_size, 16]
  const float* mins;     // [tiles, k / group_size, 16]
  void* y;               // [batch, n] in y_dtype
  DType y_dtype;
  int batch;
  int n;
  int k;
  int group_size;

  int num_blocks() const { return k / kInt4Block; }
  int num_groups() const { return k / group_size; }
  int num_tiles() const { return (n + kInt4TileRows - 1) / kInt4TileRows; }
  const uint8_t* tile_codes(int tile) const {
    return codes + static_cast<size_t>(tile) * num_blocks() * kInt4TileBlockBytes;
  }
};

// The matmul over int16 activations.
struct Int4Problem : Int4Matmul {
  const int16_t* x_quant;       // [batch, k]
  const float* x_scales;        // [batch, k / 32]
  const float* x_group_sums;    // [batch, k / group_size]: each group's fp32 sum of x
  const float* x_code_offsets;  // [batch, k / group_size]: 8 x each group's sum of x'
};

// Rows [row_begin, row_end) of x [.., k] fp32 quantized into problem-shaped buffers.
struct Int4Activations {
  const void* x;  // [batch, k] in x_dtype
  DType x_dtype;
  int16_t* x_quant;
  float* x_scales;
  float* x_group_sums;
  float* x_code_offsets;
  int k;
  int group_size;
};

// The same matmul over int8 activations (Q8_0 blocks).
struct Int4Q8Problem : Int4Matmul {
  const int8_t* x_quant;          // [batch, k]
  const float* x_scales;          // [batch, k / 32]
  const int32_t* x_code_offsets;  // [batch, k / 32]: 8 x each block's sum of x_int8
  const float* x_group_sums;      // [batch, k / group_size]: each group's fp32 sum of x
};

// Rows of x [.., k] quantized into Int4Q8Problem-shaped buffers.
struct Int4Q8Activations {
  const void* x;  // [batch, k] in x_dtype
  DType x_dtype;
  int8_t* x_quant;
  float* x_scales;
  int32_t* x_code_offsets;
  float* x_group_sums;
  int k;
  int group_size;
};

// A part of the int8 matmul for one thread: output tiles [tile_begin, tile_end) for the x rows
// [row_begin, row_end).
struct Int4Q8Range {
  int tile_begin;
  int tile_end;
  int row_begin;
  int row_end;
};

}  // namespace tandem
