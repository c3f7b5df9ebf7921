// The integer dot product of the INT4 matmul (int4_impl.h's `Dot`) in plain C++, for the
// instruction sets without one of their own (scalar, NEON): the compiler vectorizes what it can.
#pragma once

#include <cstring>

#include "int4.h"

namespace tandem {
namespace {

// A tile's 16 output columns as plain arrays, with the float operations both matmuls' epilogues use
// (int4_q8_portable.h's Q8Dot too).
struct PortableLanes {
  static constexpr int kLanes = kInt4TileRows;
  struct IVec { int32_t lanes[kLanes]; };
  struct FVec { float lanes[kLanes]; };

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
  static FVec sub(const FVec& a, const FVec& b) {
    FVec out;
    for (int i = 0; i < kLanes; ++i) out.lanes[i] = a.lanes[i] - b.lanes[i];
    return out;
  }
  static FVec fma(const FVec& a, const FVec& b, const FVec& c) {
    FVec out;
    for (int i = 0; i < kLanes; ++i) out.lanes[i] = a.lanes[i] * b.lanes[i] + c.lanes[i];
    return out;
  }
};

struct Dot : PortableLanes {
  static constexpr int kBatchTile = 4;
  static constexpr int kWeightVectors = 2 * kInt4Chunks;  // each chunk's low nibbles, then its high ones
  struct WVec { uint8_t codes[kInt4ChunkBytes]; };  // 4 codes of each of 16 rows

  static void unpack_block(const uint8_t* chunks, WVec* w) {
    for (int i = 0; i < kInt4Chunks; ++i) {
      for (int j = 0; j < kInt4ChunkBytes; ++j) {
        const uint8_t byte = chunks[i * kInt4ChunkBytes + j];
        w[i].codes[j] = byte & 0xf;
        w[kInt4Chunks + i].codes[j] = byte >> 4;
      }
    }
  }
  static IVec block_dot(const WVec* w, const int16_t* x) {
    IVec sums{};
    for (int c = 0; c < 2 * kInt4Chunks; ++c) {
      for (int lane = 0; lane < kLanes; ++lane) {
        for (int j = 0; j < 4; ++j) sums.lanes[lane] += w[c].codes[lane * 4 + j] * int32_t{x[4 * c + j]};
      }
    }
    return sums;
  }
};

}  // namespace
}  // namespace tandem
