// The INT4 matmul of every instruction set this CPU runs, against a plain double-precision reference
// on fresh random inputs, without Python: test_int4_isa_check.py cross-compiles it with the
// kernels' own sources and flags (kernels/cpu/build.py) and runs it under qemu-user, so the NEON
// paths are checked on an x86 host. Prints the usable ISAs, then one line per ISA and case; exits 1
// on a mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dispatch.h"
#include "int4.h"
#include "int4_matmul.h"

namespace {

using tandem::kInt4Block;
using tandem::kInt4ChunkBytes;
using tandem::kInt4TileBlockBytes;
using tandem::kInt4TileRows;

constexpr double kTolerance = 1e-5;  // relative to the largest |y|, as tests/kernels/test_int4.py

struct Case {
  int n, k, group_size, batch;
};

// A random weight in the tiled layout (int4.h) with its scales and mins, and random x.
struct Problem {
  Case shape;
  std::vector<uint8_t> codes;
  std::vector<float> scales, mins, x;

  explicit Problem(Case c, std::mt19937& gen) : shape(c) {
    const int tiles = (c.n + kInt4TileRows - 1) / kInt4TileRows;
    std::uniform_int_distribution<int> byte(0, 255);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    codes.resize(static_cast<size_t>(tiles) * (c.k / kInt4Block) * kInt4TileBlockBytes);
    for (uint8_t& b : codes) b = static_cast<uint8_t>(byte(gen));
    scales.resize(static_cast<size_t>(tiles) * (c.k / c.group_size) * kInt4TileRows);
    mins.resize(scales.size());
    for (size_t i = 0; i < scales.size(); ++i) {
      scales[i] = 0.01f + std::fabs(normal(gen)) * 0.1f;
      mins[i] = -8.0f * scales[i] + 0.01f * normal(gen);
    }
    x.resize(static_cast<size_t>(c.batch) * c.k);
    for (float& v : x) v = normal(gen);
  }

  // Code of weight (row, col): chunk i of a tile's block holds row r's canonical bytes 4i..4i+3.
  int code(int row, int col) const {
    const int tile = row / kInt4TileRows, block = col / kInt4Block, within = col % kInt4Block;
    const int byte = within % (kInt4Block / 2);
    const size_t offset = (static_cast<size_t>(tile) * (shape.k / kInt4Block) + block) * kInt4TileBlockBytes +
                          (byte / 4) * kInt4ChunkBytes + (row % kInt4TileRows) * 4 + byte % 4;
    return within < kInt4Block / 2 ? codes[offset] & 0xf : codes[offset] >> 4;
  }
  float param(const std::vector<float>& params, int row, int group) const {
    const int tile = row / kInt4TileRows;
    return params[(static_cast<size_t>(tile) * (shape.k / shape.group_size) + group) * kInt4TileRows +
                  row % kInt4TileRows];
  }
};

// int4.h's arithmetic: x rounded per block of 32 to ints of max_quant, codes centered at 8, the
// centered min times the exact sum of x.
std::vector<double> reference(const Problem& p, int max_quant) {
  const Case& c = p.shape;
  std::vector<double> y(static_cast<size_t>(c.batch) * c.n, 0.0);
  std::vector<double> rounded(c.k);
  for (int b = 0; b < c.batch; ++b) {
    const float* x = p.x.data() + static_cast<size_t>(b) * c.k;
    for (int block = 0; block < c.k / kInt4Block; ++block) {
      float amax = 0.0f;
      for (int i = 0; i < kInt4Block; ++i) amax = std::max(amax, std::fabs(x[block * kInt4Block + i]));
      const float inverse = amax > 0.0f ? static_cast<float>(max_quant) / amax : 0.0f;
      for (int i = 0; i < kInt4Block; ++i) {
        const float scaled = x[block * kInt4Block + i] * inverse;
        rounded[block * kInt4Block + i] = std::nearbyint(scaled) * (static_cast<double>(amax) / max_quant);
      }
    }
    for (int row = 0; row < c.n; ++row) {
      double sum = 0.0;
      for (int g = 0; g < c.k / c.group_size; ++g) {
        const double scale = p.param(p.scales, row, g), min = p.param(p.mins, row, g);
        double dot = 0.0, x_sum = 0.0;
        for (int col = g * c.group_size; col < (g + 1) * c.group_size; ++col) {
          dot += (p.code(row, col) - 8) * rounded[col];
          x_sum += x[col];
        }
        sum += scale * dot + (min + 8 * scale) * x_sum;
      }
      y[static_cast<size_t>(b) * c.n + row] = sum;
    }
  }
  return y;
}

double relative_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  double worst = 0.0, largest = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    worst = std::max(worst, std::fabs(actual[i] - expected[i]));
    largest = std::max(largest, std::fabs(expected[i]));
  }
  return worst / largest;
}

bool check(const std::string& isa, const Problem& p, int activation_bits, int threads) {
  const Case& c = p.shape;
  std::vector<float> y(static_cast<size_t>(c.batch) * c.n);
  const auto entry = activation_bits == 8 ? tandem::int4_linear : tandem::int4_linear_int16;
  entry(reinterpret_cast<uintptr_t>(p.x.data()), reinterpret_cast<uintptr_t>(p.codes.data()),
        reinterpret_cast<uintptr_t>(p.scales.data()), reinterpret_cast<uintptr_t>(p.mins.data()),
        reinterpret_cast<uintptr_t>(y.data()), static_cast<int>(tandem::DType::kFloat32), c.batch, c.n, c.k,
        c.group_size, threads, isa);
  const double error = relative_error(y, reference(p, activation_bits == 8 ? 127 : 32767));
  const bool ok = error <= kTolerance;
  std::printf("%s int%d n=%d k=%d group=%d batch=%d threads=%d: relative error %.2e %s\n", isa.c_str(),
              activation_bits, c.n, c.k, c.group_size, c.batch, threads, error, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main() {
  std::printf("usable:");
  for (const tandem::KernelTable* table : tandem::usable_kernels()) std::printf(" %s", table->name);
  std::printf("\n");
  // ragged against the tile (16 columns), the register blocks (4, 8 rows) and each group size
  const Case cases[] = {{33, 96, 32, 1}, {40, 128, 128, 3}, {577, 320, 64, 17}, {50, 192, 64, 65}, {24, 64, 32, 300}};
  std::mt19937 gen(20240601);
  bool ok = true;
  for (const Case& c : cases) {
    const Problem problem(c, gen);
    for (const tandem::KernelTable* table : tandem::usable_kernels()) {
      for (int bits : {8, 16}) ok = check(table->name, problem, bits, c.batch > 8 ? 3 : 1) && ok;
    }
  }
  return ok ? 0 : 1;
}
