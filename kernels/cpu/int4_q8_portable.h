// The int8-activation matmul's dot products (int4_q8_impl.h's `Q8Dot`) in plain C++, for the scalar
// path: one vector is a tile's 16 output columns.
#pragma once

#include "int4.h"
#include "int4_portable.h"

namespace tandem {
namespace {

struct Q8Dot : PortableLanes {
  static constexpr int kRowTile = 4;

  static IVec set1_int(int32_t value) {
    IVec out;
    for (int32_t& lane : out.lanes) lane = value;
    return out;
  }
  // Chunk i's byte 4 * lane + j holds row `lane`'s codes 4i + j (low nibble) and 16 + 4i + j (high).
  template <int kRows>
  static void block_dots(const uint8_t* chunks, const int8_t* x, size_t row_stride, IVec* sums) {
    for (int i = 0; i < kInt4Chunks; ++i) {
      for (int lane = 0; lane < kLanes; ++lane) {
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = chunks[i * kInt4ChunkBytes + 4 * lane + j];
          for (int r = 0; r < kRows; ++r) {
            const int8_t* row = x + r * row_stride;
            sums[r].lanes[lane] += (byte & 0xf) * int32_t{row[4 * i + j]} +
                                   (byte >> 4) * int32_t{row[kInt4Block / 2 + 4 * i + j]};
          }
        }
      }
    }
  }
};

}  // namespace
}  // namespace tandem
