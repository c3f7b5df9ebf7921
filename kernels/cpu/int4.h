// Group-wise 4-bit weights and the small-batch matmul over them: y = x @ W^T.
//
// W [n, k] is stored as
//   qweight [n, k / 2] uint8: every run of 32 weights along k is 16 bytes, byte i holding
//     weight i in its low nibble and weight i + 16 in its high nibble (GGUF Q4_0/Q4_1's own
//     order, so those blocks repack by copying), and a block unpacks into two contiguous halves
//     with one mask and one shift;
//   scales, mins [n, k / group_size] fp32: weight = scale * q + min, q in [0, 15].
// The weights are never widened to a matrix: each block is unpacked in registers and used for
// every batch row of a tile while it is there, so the packed bytes are read once per call for up
// to kInt4BatchTile rows (a larger batch reads them once per tile, from cache after the first).
#pragma once

#include <cstdint>

namespace tandem {

constexpr int kInt4Block = 32;       // weights per 16-byte block; group_size is a multiple of it
constexpr int kInt4BatchTile = 4;    // batch rows that share one unpacked block

struct Int4Problem {
  const float* x;             // [batch, k]
  const float* x_group_sums;  // [batch, k / group_size]: each group's sum of x, for the mins
  const uint8_t* qweight;     // [n, k / 2]
  const float* scales;        // [n, k / group_size]
  const float* mins;          // [n, k / group_size]
  float* y;                   // [batch, n]
  int batch;
  int n;
  int k;
  int group_size;
};

}  // namespace tandem
