// The INT4 matmul over int4.h's tiled layout, written once against the `Dot` struct of the
// translation unit that includes it (its integer dot product and the fp32 vector it accumulates
// in) and the `Isa` struct (for the dequantize's stores in bf16/fp16).
//
// Dot provides: kLanes (output rows per vector; kInt4TileRows is a multiple), kBatchTile (rows
// of x that share one unpacked block), WVec / IVec / FVec, unpack_block (a block's 4 chunks of one
// vector's rows -> 8 vectors of codes 0..15, chunk i's low nibbles first), block_dot (8 code
// vectors x a block's 32 int8 activations -> int32 per row), to_float, zero, set1, load, fma, store.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int4.h"

namespace tandem {
namespace {

constexpr int kInt4Vectors = kInt4TileRows / Dot::kLanes;  // vectors per tile row range
constexpr int kPrefetchBytes = 8 * kInt4TileBlockBytes;  // how far ahead of the block in use

template <typename T, int kLanes>
inline void store_converted(T* y, const float* lanes, int count) {
  alignas(64) T converted[kLanes];
  for (int i = 0; i < kLanes; i += Isa::kWidth) Isa::store(converted + i, Isa::load(lanes + i));
  std::copy(converted, converted + count, y);
}

// Writes lanes [0, count) of v (a `Vectors::FVec`: Dot's or Q8Dot's) to y's element `offset` on,
// in y's dtype.
template <typename Vectors>
inline void store_lanes(void* y, DType y_dtype, size_t offset, typename Vectors::FVec v, int count) {
  constexpr int kLanes = Vectors::kLanes;
  if (y_dtype == DType::kFloat32 && count == kLanes) {
    Vectors::store(static_cast<float*>(y) + offset, v);
    return;
  }
  alignas(64) float lanes[kLanes];
  Vectors::store(lanes, v);
  switch (y_dtype) {
    case DType::kFloat32: std::copy(lanes, lanes + count, static_cast<float*>(y) + offset); break;
    case DType::kBFloat16: store_converted<BFloat16, kLanes>(static_cast<BFloat16*>(y) + offset, lanes, count); break;
    case DType::kFloat16: store_converted<Float16, kLanes>(static_cast<Float16*>(y) + offset, lanes, count); break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

// Row `row` of x [.., k] in x_dtype, widened to fp32 into out [k].
inline void widen_row(const void* x, DType x_dtype, int row, int k, float* out) {
  const size_t first = static_cast<size_t>(row) * k;
  for (int i = 0; i < k; i += Isa::kWidth) {
    switch (x_dtype) {
      case DType::kFloat32: Isa::store(out + i, Isa::load(static_cast<const float*>(x) + first + i)); break;
      case DType::kBFloat16: Isa::store(out + i, Isa::load(static_cast<const BFloat16*>(x) + first + i)); break;
      case DType::kFloat16: Isa::store(out + i, Isa::load(static_cast<const Float16*>(x) + first + i)); break;
      case DType::kInt8:
      case DType::kInt4:
      case DType::kK8V4: break;  // KV cache formats, never a compute dtype
    }
  }
}

// Vector `v` of tile `tile` (rows tile * 16 + v * kLanes ...) for the x rows [b0, b0 + kRows).
template <int kRows>
void int4_tile_vector(const Int4Problem& p, int tile, int v, int b0) {
  using FVec = typename Dot::FVec;
  const int num_blocks = p.num_blocks();
  const int num_groups = p.num_groups();
  const int blocks_per_group = p.group_size / kInt4Block;
  const uint8_t* codes = p.tile_codes(tile) + v * Dot::kLanes * 4;
  const size_t params = static_cast<size_t>(tile) * num_groups * kInt4TileRows + v * Dot::kLanes;
  FVec acc[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = Dot::zero();
  for (int g = 0; g < num_groups; ++g) {
    FVec group_acc[kRows];  // sum over the group's blocks of x_scale * <q, x_int16>
    for (int b = 0; b < kRows; ++b) group_acc[b] = Dot::zero();
    for (int block = g * blocks_per_group; block < (g + 1) * blocks_per_group; ++block) {
      typename Dot::WVec w[Dot::kWeightVectors];
      const uint8_t* block_codes = codes + static_cast<size_t>(block) * kInt4TileBlockBytes;
      for (int line = 0; line < kInt4TileBlockBytes; line += 64) __builtin_prefetch(block_codes + kPrefetchBytes + line);
      Dot::unpack_block(block_codes, w);
      for (int b = 0; b < kRows; ++b) {
        const size_t row = b0 + b;
        const auto dot = Dot::block_dot(w, p.x_quant + row * p.k + block * kInt4Block);
        group_acc[b] = Dot::fma(Dot::to_float(dot), Dot::set1(p.x_scales[row * num_blocks + block]), group_acc[b]);
      }
    }
    const FVec scale = Dot::load(p.scales + params + static_cast<size_t>(g) * kInt4TileRows);
    const FVec centered_min = Dot::fma(Dot::set1(kInt4CodeCenter), scale,
                                        Dot::load(p.mins + params + static_cast<size_t>(g) * kInt4TileRows));
    for (int b = 0; b < kRows; ++b) {
      const size_t row_group = static_cast<size_t>(b0 + b) * num_groups + g;
      const FVec centered = Dot::sub(group_acc[b], Dot::set1(p.x_code_offsets[row_group]));
      acc[b] = Dot::fma(centered, scale, Dot::fma(centered_min, Dot::set1(p.x_group_sums[row_group]), acc[b]));
    }
  }
  const int col = tile * kInt4TileRows + v * Dot::kLanes;
  const int count = std::min(Dot::kLanes, p.n - col);
  if (count <= 0) return;
  for (int b = 0; b < kRows; ++b) store_lanes<Dot>(p.y, p.y_dtype, static_cast<size_t>(b0 + b) * p.n + col, acc[b], count);
}

template <int kRows>
void int4_tile_rows(const Int4Problem& p, int tile, int b0) {
  for (int v = 0; v < kInt4Vectors; ++v) int4_tile_vector<kRows>(p, tile, v, b0);
}

// Rows [b0, b0 + rows) with rows <= kBatchTile, through the instantiation for that count.
template <int kRows = Dot::kBatchTile>
void int4_tile_dispatch(const Int4Problem& p, int tile, int b0, int rows) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      int4_tile_dispatch<kRows - 1>(p, tile, b0, rows);
      return;
    }
  }
  int4_tile_rows<kRows>(p, tile, b0);
}

// Output tiles [tile_begin, tile_end) for the whole batch; a tile's codes stay in cache while
// every batch slice passes over them.
void int4_tiles(const Int4Problem& p, int tile_begin, int tile_end) {
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    for (int b0 = 0; b0 < p.batch; b0 += Dot::kBatchTile) {
      int4_tile_dispatch(p, tile, b0, std::min(Dot::kBatchTile, p.batch - b0));
    }
  }
}

// x rows [row_begin, row_end) to int16 per block of 32, with each block's scale, each group's fp32
// sum and its code offset (int4.h).
void int4_quantize_rows(const Int4Activations& a, int row_begin, int row_end) {
  const int num_blocks = a.k / kInt4Block;
  const int blocks_per_group = a.group_size / kInt4Block;
  std::vector<float> widened(a.k);  // the row in fp32
  for (int row = row_begin; row < row_end; ++row) {
    widen_row(a.x, a.x_dtype, row, a.k, widened.data());
    const float* x = widened.data();
    int16_t* q = a.x_quant + static_cast<size_t>(row) * a.k;
    float* group_sums = a.x_group_sums + static_cast<size_t>(row) * (num_blocks / blocks_per_group);
    float* code_offsets = a.x_code_offsets + static_cast<size_t>(row) * (num_blocks / blocks_per_group);
    for (int block = 0; block < num_blocks; ++block) {
      const float* xb = x + block * kInt4Block;
      float amax = 0.0f;
      float sum = 0.0f;
      for (int i = 0; i < kInt4Block; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
      }
      const float inverse = amax > 0.0f ? kInt4MaxQuant / amax : 0.0f;
      int32_t quant_sum = 0;
      for (int i = 0; i < kInt4Block; ++i) {
        const int16_t value = static_cast<int16_t>(std::nearbyint(xb[i] * inverse));
        q[block * kInt4Block + i] = value;
        quant_sum += value;
      }
      const float scale = amax / kInt4MaxQuant;
      a.x_scales[static_cast<size_t>(row) * num_blocks + block] = scale;
      const int group = block / blocks_per_group;
      if (block % blocks_per_group == 0) group_sums[group] = code_offsets[group] = 0.0f;
      group_sums[group] += sum;
      code_offsets[group] += kInt4CodeCenter * scale * static_cast<float>(quant_sum);
    }
  }
}

// Rows [row_begin, row_end) of W (tile-aligned row_begin) written densely to out
// ([row_end - row_begin, k], T = float, BFloat16 or Float16).
template <typename T>
void int4_dequantize_typed(const Int4Problem& p, T* out, int row_begin, int row_end) {
  const int num_groups = p.num_groups();
  const int blocks_per_group = p.group_size / kInt4Block;
  alignas(64) float values[kInt4Block];
  for (int row = row_begin; row < row_end; ++row) {
    const int tile = row / kInt4TileRows;
    const int lane = row % kInt4TileRows;
    const uint8_t* codes = p.tile_codes(tile) + lane * 4;
    T* dst = out + static_cast<size_t>(row - row_begin) * p.k;
    for (int g = 0; g < num_groups; ++g) {
      const size_t param = (static_cast<size_t>(tile) * num_groups + g) * kInt4TileRows + lane;
      const float scale = p.scales[param];
      const float min = p.mins[param];
      for (int block = g * blocks_per_group; block < (g + 1) * blocks_per_group; ++block) {
        const uint8_t* chunks = codes + static_cast<size_t>(block) * kInt4TileBlockBytes;
        uint8_t bytes[kInt4Block / 2];  // the row's 16 canonical bytes of the block, gathered
        for (int i = 0; i < kInt4Chunks; ++i) std::memcpy(bytes + 4 * i, chunks + i * kInt4ChunkBytes, 4);
        for (int i = 0; i < kInt4Block / 2; ++i) {  // plain loops: the compiler vectorizes them
          values[i] = scale * static_cast<float>(bytes[i] & 0xf) + min;
          values[kInt4Block / 2 + i] = scale * static_cast<float>(bytes[i] >> 4) + min;
        }
        for (int i = 0; i < kInt4Block; i += Isa::kWidth) Isa::store(dst + block * kInt4Block + i, Isa::load(values + i));
      }
    }
  }
}

void int4_dequantize(const Int4Problem& p, void* out, DType dtype, int row_begin, int row_end) {
  switch (dtype) {
    case DType::kFloat32: int4_dequantize_typed(p, static_cast<float*>(out), row_begin, row_end); break;
    case DType::kBFloat16: int4_dequantize_typed(p, static_cast<BFloat16*>(out), row_begin, row_end); break;
    case DType::kFloat16: int4_dequantize_typed(p, static_cast<Float16*>(out), row_begin, row_end); break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

}  // namespace
}  // namespace tandem
