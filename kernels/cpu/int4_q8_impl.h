// The INT4 matmul over int8 activations (int4.h: Q8_0 blocks), written once against the `Q8Dot`
// struct of the translation unit that includes it, after int4_impl.h (store_lanes, widen_row).
//
// Q8Dot provides: kLanes (output columns per vector; kInt4TileRows is a multiple), kRowTile (rows
// of x that share each unpacked chunk: the register block), IVec / FVec, block_dots<kRows> (adds
// each row's integer dot product of one 32-weight block to its IVec, one lane per output column),
// set1_int, to_float, zero, set1, load, fma, store.
//
// Blocking: a thread owns a range of output tiles and of x rows. Its rows go in panels whose int8
// activations fit in a share of L2 (kQ8PanelBytes); within a panel every tile of the range passes
// over all the panel's rows kRowTile at a time, so a 16-row strip of the weight (k / 2 bytes) is
// read once per panel from memory and from cache for each row block, and a weight's whole matmul
// reads it ceil(rows / panel rows) times however many rows there are.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "int4.h"

namespace tandem {
namespace {

constexpr int kQ8Vectors = kInt4TileRows / Q8Dot::kLanes;  // vectors per tile
constexpr size_t kQ8PanelBytes = 512 << 10;  // int8 activations of one panel: half a 1 MiB L2

// Rows [row0, row0 + kRows) of x against vector v of `tile` (its kLanes output columns).
template <int kRows>
void q8_tile_vector(const Int4Q8Problem& p, int tile, int v, int row0) {
  using FVec = typename Q8Dot::FVec;
  using IVec = typename Q8Dot::IVec;
  const int num_blocks = p.num_blocks();
  const int num_groups = p.num_groups();
  const int blocks_per_group = p.group_size / kInt4Block;
  const uint8_t* codes = p.tile_codes(tile) + v * Q8Dot::kLanes * 4;
  const size_t params = static_cast<size_t>(tile) * num_groups * kInt4TileRows + v * Q8Dot::kLanes;
  const int8_t* x = p.x_quant + static_cast<size_t>(row0) * p.k;
  const float* x_scales = p.x_scales + static_cast<size_t>(row0) * num_blocks;
  const int32_t* code_offsets = p.x_code_offsets + static_cast<size_t>(row0) * num_blocks;
  const float* group_sums = p.x_group_sums + static_cast<size_t>(row0) * num_groups;
  FVec acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = Q8Dot::zero();
  for (int g = 0; g < num_groups; ++g) {
    FVec group_acc[kRows];  // sum over the group's blocks of x_scale * <q - 8, x_int8>
    for (int r = 0; r < kRows; ++r) group_acc[r] = Q8Dot::zero();
    for (int block = g * blocks_per_group; block < (g + 1) * blocks_per_group; ++block) {
      const uint8_t* block_codes = codes + static_cast<size_t>(block) * kInt4TileBlockBytes;
      for (int line = 0; line < kInt4TileBlockBytes; line += 64) __builtin_prefetch(block_codes + kPrefetchBytes + line);
      IVec sums[kRows];  // start at -8 sum(x_int8): the codes' center, subtracted in integers
      for (int r = 0; r < kRows; ++r) sums[r] = Q8Dot::set1_int(-code_offsets[r * num_blocks + block]);
      Q8Dot::template block_dots<kRows>(block_codes, x + block * kInt4Block, p.k, sums);
      for (int r = 0; r < kRows; ++r) {
        group_acc[r] = Q8Dot::fma(Q8Dot::to_float(sums[r]), Q8Dot::set1(x_scales[r * num_blocks + block]), group_acc[r]);
      }
    }
    const size_t group_params = params + static_cast<size_t>(g) * kInt4TileRows;
    const FVec scale = Q8Dot::load(p.scales + group_params);
    const FVec centered_min = Q8Dot::fma(Q8Dot::set1(kInt4CodeCenter), scale, Q8Dot::load(p.mins + group_params));
    for (int r = 0; r < kRows; ++r) {
      acc[r] = Q8Dot::fma(group_acc[r], scale,
                          Q8Dot::fma(centered_min, Q8Dot::set1(group_sums[r * num_groups + g]), acc[r]));
    }
  }
  const int col = tile * kInt4TileRows + v * Q8Dot::kLanes;
  const int count = std::min(Q8Dot::kLanes, p.n - col);
  if (count <= 0) return;
  for (int r = 0; r < kRows; ++r) {
    store_lanes<Q8Dot>(p.y, p.y_dtype, static_cast<size_t>(row0 + r) * p.n + col, acc[r], count);
  }
}

// Rows [row0, row0 + rows) with rows <= kRowTile, through the instantiation for that count.
template <int kRows = Q8Dot::kRowTile>
void q8_tile_vector_dispatch(const Int4Q8Problem& p, int tile, int v, int row0, int rows) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      q8_tile_vector_dispatch<kRows - 1>(p, tile, v, row0, rows);
      return;
    }
  }
  q8_tile_vector<kRows>(p, tile, v, row0);
}

// Whole register blocks: a ragged one reads the weight for fewer rows.
int q8_panel_rows(int k) {
  const int rows = static_cast<int>(kQ8PanelBytes / static_cast<size_t>(k));
  return std::max(Q8Dot::kRowTile, rows / Q8Dot::kRowTile * Q8Dot::kRowTile);
}

void int4_q8_tiles(const Int4Q8Problem& p, const Int4Q8Range& range) {
  const int panel_rows = q8_panel_rows(p.k);
  for (int panel = range.row_begin; panel < range.row_end; panel += panel_rows) {
    const int panel_end = std::min(panel + panel_rows, range.row_end);
    for (int tile = range.tile_begin; tile < range.tile_end; ++tile) {
      for (int v = 0; v < kQ8Vectors; ++v) {
        for (int row0 = panel; row0 < panel_end; row0 += Q8Dot::kRowTile) {
          q8_tile_vector_dispatch(p, tile, v, row0, std::min(Q8Dot::kRowTile, panel_end - row0));
        }
      }
    }
  }
}

struct Q8Block {
  float scale;
  float sum;          // of the fp32 x
  int32_t quant_sum;  // of the int8 codes
};

// One block of 32 of x to int8 codes q.
inline Q8Block q8_quantize_block(const float* x, int8_t* q) {
  typename Isa::Vec abs_max = Isa::zero();
  typename Isa::Vec sums = Isa::zero();
  for (int i = 0; i < kInt4Block; i += Isa::kWidth) {
    const typename Isa::Vec value = Isa::load(x + i);
    abs_max = Isa::max(abs_max, Isa::max(value, Isa::sub(Isa::zero(), value)));
    sums = Isa::add(sums, value);
  }
  const float amax = Isa::reduce_max(abs_max);
  const float inverse = amax > 0.0f ? kInt4MaxQuant8 / amax : 0.0f;
  int32_t sum = 0;
  for (int i = 0; i < kInt4Block; ++i) {
    // nearbyint vectorizes (vroundps, frinti) and keeps the product from fusing into an add
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));
    sum += q[i];
  }
  return Q8Block{amax / kInt4MaxQuant8, Isa::reduce_add(sums), sum};
}

// x rows [row_begin, row_end) to int8 per block of 32, with each block's scale and code offset
// and each group's fp32 sum (int4.h).
void int4_q8_quantize_rows(const Int4Q8Activations& a, int row_begin, int row_end) {
  const int num_blocks = a.k / kInt4Block;
  const int blocks_per_group = a.group_size / kInt4Block;
  const int num_groups = num_blocks / blocks_per_group;
  std::vector<float> widened(a.k);  // the row in fp32
  for (int row = row_begin; row < row_end; ++row) {
    widen_row(a.x, a.x_dtype, row, a.k, widened.data());
    const size_t first_block = static_cast<size_t>(row) * num_blocks;
    int8_t* q = a.x_quant + static_cast<size_t>(row) * a.k;
    float* group_sums = a.x_group_sums + static_cast<size_t>(row) * num_groups;
    for (int block = 0; block < num_blocks; ++block) {
      const Q8Block quantized = q8_quantize_block(widened.data() + block * kInt4Block, q + block * kInt4Block);
      a.x_scales[first_block + block] = quantized.scale;
      a.x_code_offsets[first_block + block] = kInt4CodeCenter * quantized.quant_sum;
      const int group = block / blocks_per_group;
      group_sums[group] = (block % blocks_per_group == 0 ? 0.0f : group_sums[group]) + quantized.sum;
    }
  }
}

}  // namespace
}  // namespace tandem
