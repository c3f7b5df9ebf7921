// The INT4 matmul, written once against the `Isa` struct of the translation unit that includes
// it (see int4.h for the layout). An Isa with `unpack_int4` widens a block's nibbles in
// registers; any other unpacks through a small float buffer.
#pragma once

#include <type_traits>

#include "int4.h"

namespace tandem {
namespace {

constexpr int kInt4Vectors = kInt4Block / Isa::kWidth;  // vectors per unpacked block

template <typename I, typename = void>
struct HasInt4Unpack : std::false_type {};
template <typename I>
struct HasInt4Unpack<I, std::void_t<decltype(I::unpack_int4(nullptr, nullptr))>> : std::true_type {};

// The 32 weights of one block as floats 0..15, in weight order. (A template so that the branch
// an Isa does not take is never compiled for it.)
template <typename I = Isa>
inline void unpack_block(const uint8_t* bytes, typename I::Vec* out) {
  if constexpr (HasInt4Unpack<I>::value) {
    I::unpack_int4(bytes, out);
  } else {
    alignas(64) float values[kInt4Block];
    for (int i = 0; i < kInt4Block / 2; ++i) {
      values[i] = static_cast<float>(bytes[i] & 0xf);
      values[i + kInt4Block / 2] = static_cast<float>(bytes[i] >> 4);
    }
    for (int v = 0; v < kInt4Vectors; ++v) out[v] = I::load(values + v * I::kWidth);
  }
}

// Output column `row` of W for batch rows [b0, b0 + kRows).
template <int kRows>
void int4_row_tile(const Int4Problem& p, int row, int b0) {
  using Vec = typename Isa::Vec;
  const int num_groups = p.k / p.group_size;
  const int blocks_per_group = p.group_size / kInt4Block;
  const uint8_t* q = p.qweight + static_cast<size_t>(row) * (p.k / 2);
  const float* scales = p.scales + static_cast<size_t>(row) * num_groups;
  const float* mins = p.mins + static_cast<size_t>(row) * num_groups;
  Vec acc[kRows];
  float min_terms[kRows];
  for (int b = 0; b < kRows; ++b) {
    acc[b] = Isa::zero();
    min_terms[b] = 0.0f;
  }
  for (int g = 0; g < num_groups; ++g) {
    Vec dot[kRows];  // sum of q * x over the group, before its scale
    for (int b = 0; b < kRows; ++b) dot[b] = Isa::zero();
    for (int block = 0; block < blocks_per_group; ++block) {
      const int k0 = (g * blocks_per_group + block) * kInt4Block;
      Vec w[kInt4Vectors];
      unpack_block(q + k0 / 2, w);
      for (int b = 0; b < kRows; ++b) {
        const float* x = p.x + static_cast<size_t>(b0 + b) * p.k + k0;
        for (int v = 0; v < kInt4Vectors; ++v) dot[b] = Isa::fma(w[v], Isa::load(x + v * Isa::kWidth), dot[b]);
      }
    }
    const Vec scale = Isa::set1(scales[g]);
    for (int b = 0; b < kRows; ++b) {
      acc[b] = Isa::fma(scale, dot[b], acc[b]);
      min_terms[b] += mins[g] * p.x_group_sums[static_cast<size_t>(b0 + b) * num_groups + g];
    }
  }
  for (int b = 0; b < kRows; ++b) {
    p.y[static_cast<size_t>(b0 + b) * p.n + row] = Isa::reduce_add(acc[b]) + min_terms[b];
  }
}

// Output columns [row_begin, row_end) for the whole batch.
void int4_rows(const Int4Problem& p, int row_begin, int row_end) {
  static_assert(kInt4BatchTile == 4, "the tile dispatch below covers 1..4 rows");
  for (int row = row_begin; row < row_end; ++row) {
    for (int b0 = 0; b0 < p.batch; b0 += kInt4BatchTile) {
      switch (p.batch - b0) {
        case 1: int4_row_tile<1>(p, row, b0); break;
        case 2: int4_row_tile<2>(p, row, b0); break;
        case 3: int4_row_tile<3>(p, row, b0); break;
        default: int4_row_tile<4>(p, row, b0); break;
      }
    }
  }
}

// Rows [row_begin, row_end) of W written densely to out ([row_end - row_begin, k], T = float,
// BFloat16 or Float16): the large-batch path multiplies such tiles with a dense GEMM.
template <typename T>
void int4_dequantize_typed(const Int4Problem& p, T* out, int row_begin, int row_end) {
  const int num_groups = p.k / p.group_size;
  const int blocks_per_group = p.group_size / kInt4Block;
  for (int row = row_begin; row < row_end; ++row) {
    const uint8_t* q = p.qweight + static_cast<size_t>(row) * (p.k / 2);
    T* dst = out + static_cast<size_t>(row - row_begin) * p.k;
    for (int g = 0; g < num_groups; ++g) {
      const size_t group = static_cast<size_t>(row) * num_groups + g;
      const typename Isa::Vec scale = Isa::set1(p.scales[group]);
      const typename Isa::Vec min = Isa::set1(p.mins[group]);
      for (int block = 0; block < blocks_per_group; ++block) {
        const int k0 = (g * blocks_per_group + block) * kInt4Block;
        typename Isa::Vec w[kInt4Vectors];
        unpack_block(q + k0 / 2, w);
        for (int v = 0; v < kInt4Vectors; ++v) Isa::store(dst + k0 + v * Isa::kWidth, Isa::fma(w[v], scale, min));
      }
    }
  }
}

void int4_dequantize(const Int4Problem& p, void* out, DType dtype, int row_begin, int row_end) {
  switch (dtype) {
    case DType::kFloat32: int4_dequantize_typed(p, static_cast<float*>(out), row_begin, row_end); break;
    case DType::kBFloat16: int4_dequantize_typed(p, static_cast<BFloat16*>(out), row_begin, row_end); break;
    case DType::kFloat16: int4_dequantize_typed(p, static_cast<Float16*>(out), row_begin, row_end); break;
  }
}

}  // namespace
}  // namespace tandem
