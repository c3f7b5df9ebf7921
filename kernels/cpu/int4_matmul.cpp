#include "int4_matmul.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "dispatch.h"
#include "thread_pool.h"

namespace tandem {
namespace {

// Output tiles one thread should own at least before x's rows are split too: fewer, and the
// threads' shares of a small weight are uneven in whole tiles.
constexpr int kMinTilesPerThread = 8;
// Rows below which splitting x's rows over threads costs more in weight reads than it evens out.
constexpr int kMinRowsPerThread = 16;

void check_int4_shape(int batch, int n, int k, int group_size, int num_threads) {
  if (num_threads < 1 || num_threads > kMaxThreads) {
    throw std::invalid_argument("num_threads must be in [1, " + std::to_string(kMaxThreads) +
                                "], got " + std::to_string(num_threads));
  }
  if (group_size <= 0 || group_size % kInt4Block != 0 || k <= 0 || k % group_size != 0) {
    throw std::invalid_argument("k (" + std::to_string(k) + ") must be a positive multiple of group_size (" +
                                std::to_string(group_size) + "), itself a multiple of " +
                                std::to_string(kInt4Block));
  }
  if (batch < 0 || n < 1) throw std::invalid_argument("batch must be >= 0 and n >= 1");
}

// How the int8 matmul's threads share the work: column parts of whole tiles, each split in row
// parts when there are more threads than a weight's tiles keep busy and rows enough to share.
struct Q8Split {
  int column_parts;
  int row_parts;

  int threads() const { return column_parts * row_parts; }
  Int4Q8Range range(int num_tiles, int batch, int thread) const {
    const auto [tile_begin, tile_end] = split_range(num_tiles, column_parts, thread % column_parts);
    const auto [row_begin, row_end] = split_range(batch, row_parts, thread / column_parts);
    return {tile_begin, tile_end, row_begin, row_end};
  }
};

Q8Split q8_split(int num_tiles, int batch, int num_threads) {
  const int row_parts = std::clamp(std::min(num_threads * kMinTilesPerThread / std::max(num_tiles, 1), batch / kMinRowsPerThread),
                                   1, num_threads);
  const int column_parts = std::min(num_tiles, num_threads / row_parts);
  return {column_parts, row_parts};
}

// A call's weight, output and shape, from its raw arguments.
Int4Matmul matmul_of(uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t y, DType dtype, int batch, int n,
                     int k, int group_size) {
  return {reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scales),
          reinterpret_cast<const float*>(mins), reinterpret_cast<void*>(y), dtype, batch, n, k, group_size};
}

// Rows [0, batch) of x quantized on up to num_threads threads, each its own contiguous run.
// Quantized here rather than by torch ops before the call, whose OpenMP threads would go on
// spinning on the cores the kernel's threads are about to use.
template <typename QuantizeRows>
void quantize_in_parallel(int batch, int num_threads, const QuantizeRows& quantize_rows) {
  const int threads = std::min(num_threads, batch);
  ThreadPool::instance().run(threads, [&](int thread) {
    const auto [begin, end] = split_range(batch, threads, thread);
    quantize_rows(begin, end);
  });
}

}  // namespace

void int4_linear(uintptr_t x, uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t y, int dtype, int batch,
                 int n, int k, int group_size, int num_threads, const std::string& isa) {
  check_int4_shape(batch, n, k, group_size, num_threads);
  if (batch == 0) return;
  const KernelTable& kernels = select_kernels(isa);
  const size_t num_blocks = static_cast<size_t>(batch) * (k / kInt4Block);
  std::vector<int8_t> x_quant(static_cast<size_t>(batch) * k);
  std::vector<float> x_scales(num_blocks);
  std::vector<int32_t> code_offsets(num_blocks);
  std::vector<float> group_sums(static_cast<size_t>(batch) * (k / group_size));
  const Int4Q8Activations activations{reinterpret_cast<const void*>(x), static_cast<DType>(dtype), x_quant.data(),
                                      x_scales.data(), code_offsets.data(), group_sums.data(), k, group_size};
  quantize_in_parallel(batch, num_threads,
                       [&](int begin, int end) { kernels.int4_q8_quantize_rows(activations, begin, end); });
  const Int4Q8Problem p{matmul_of(codes, scales, mins, y, static_cast<DType>(dtype), batch, n, k, group_size),
                        x_quant.data(), x_scales.data(), code_offsets.data(), group_sums.data()};
  const Q8Split split = q8_split(p.num_tiles(), batch, num_threads);
  ThreadPool::instance().run(split.threads(), [&](int thread) {
    kernels.int4_q8_tiles(p, split.range(p.num_tiles(), batch, thread));
  });
}

void int4_linear_int16(uintptr_t x, uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t y, int dtype,
                       int batch, int n, int k, int group_size, int num_threads, const std::string& isa) {
  check_int4_shape(batch, n, k, group_size, num_threads);
  if (batch == 0) return;
  const KernelTable& kernels = select_kernels(isa);
  std::vector<int16_t> x_quant(static_cast<size_t>(batch) * k);
  std::vector<float> x_scales(static_cast<size_t>(batch) * (k / kInt4Block));
  std::vector<float> group_sums(static_cast<size_t>(batch) * (k / group_size));
  std::vector<float> code_offsets(group_sums.size());
  const Int4Activations activations{reinterpret_cast<const void*>(x), static_cast<DType>(dtype), x_quant.data(),
                                    x_scales.data(), group_sums.data(), code_offsets.data(), k, group_size};
  quantize_in_parallel(batch, num_threads,
                       [&](int begin, int end) { kernels.int4_quantize_rows(activations, begin, end); });
  const Int4Problem p{matmul_of(codes, scales, mins, y, static_cast<DType>(dtype), batch, n, k, group_size),
                      x_quant.data(), x_scales.data(), group_sums.data(), code_offsets.data()};
  // Contiguous runs of tiles: each thread streams its own part of the packed weight once.
  const int num_tiles = p.num_tiles();
  const int threads = std::min(num_threads, num_tiles);
  ThreadPool::instance().run(threads, [&](int thread) {
    const auto [begin, end] = split_range(num_tiles, threads, thread);
    kernels.int4_tiles(p, begin, end);
  });
}

void int4_dequantize(uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t out, int out_dtype, int n,
                     int k, int group_size, int num_threads, const std::string& isa) {
  check_int4_shape(0, n, k, group_size, num_threads);
  const KernelTable& kernels = select_kernels(isa);
  const Int4Problem p{matmul_of(codes, scales, mins, 0, DType::kFloat32, 0, n, k, group_size), nullptr, nullptr,
                      nullptr, nullptr};
  const int threads = std::min(num_threads, n);
  const size_t row_bytes = static_cast<size_t>(k) * dtype_size(static_cast<DType>(out_dtype));
  ThreadPool::instance().run(threads, [&](int thread) {
    const auto [begin, end] = split_range(n, threads, thread);
    kernels.int4_dequantize(p, reinterpret_cast<char*>(out) + begin * row_bytes, static_cast<DType>(out_dtype),
                            begin, end);
  });
}

}  // namespace tandem
