// The int8-activation matmul's dot products (int4_q8_impl.h's `Q8Dot`) in plain C++, for the scalar
// path: one vector is a tile's 16 output columns.
#pragma once

#include <cstring>

#include "int4.h"

namespace tandem {
namespace {

struct Q8Dot {
  static constexpr int kLanes = kInt4TileRows;
  static constexpr int kRowTile = 4;
  struct IVec { int32_t lanes[kLanes]; };
  struct FVec { float lanes[kLanes]; };

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
  static FVec to_float(const IVec& v) {
    FVec out;
    for (int i = 0; i < kLanes; ++i) out.lanes[i] = static_cast<float>(v.lanes[i]);
    return out;
  }
  static FVec zero() { return FVec{}; }
  static FVec set1(float value) {
    FVec out;
    for (float& lane : out.lanes) lane = value;
    return out;
  }
  static FVec load(const float* p) {
    FVec out;
    std::memcpy(out.lanes, p, sizeof(out.lanes));
    return out;
  }
  static void store(float* p, const FVec& v) { std::memcpy(p, v.lanes, sizeof(v.lanes)); }
  static FVec fma(const FVec& a, const FVec& b, const FVec& c) {
    FVec out;
    for (int i = 0; i < kLanes; ++i) out.lanes[i] = a.lanes[i] * b.lanes[i] + c.lanes[i];
    return out;
  }
};

}  // namespace
}  // namespace tandem
