// A dense matmul for a few rows of x (decode): y = x @ W^T with W [n, k] in fp32, bf16 or fp16,
// x and y fp32, written once against the `Isa` struct of the translation unit that includes it.
// Each output column is one pass over a row of W, widened in registers and used for every row of
// x, so W is read once at memory speed; torch's bf16 GEMV read the 56 MB LM head of the embedded
// model at about 13 GB/s on the 2-core VM.
#pragma once

#include <algorithm>

#include "dtypes.h"

namespace tandem {
namespace {

template <typename T, int kRows>
void gemv_typed(const GemvProblem& p, int col_begin, int col_end) {
  using Vec = typename Isa::Vec;
  const T* w = static_cast<const T*>(p.w);
  for (int col = col_begin; col < col_end; ++col) {
    const T* wr = w + static_cast<size_t>(col) * p.k;
    Vec acc[kRows];
    for (int b = 0; b < kRows; ++b) acc[b] = Isa::zero();
    for (int i = 0; i < p.k; i += Isa::kWidth) {
      const Vec wv = Isa::load(wr + i);
      for (int b = 0; b < kRows; ++b) acc[b] = Isa::fma(wv, Isa::load(p.x + static_cast<size_t>(b) * p.k + i), acc[b]);
    }
    for (int b = 0; b < kRows; ++b) p.y[static_cast<size_t>(b) * p.n + col] = Isa::reduce_add(acc[b]);
  }
}

template <typename T>
void gemv_dispatch(const GemvProblem& p, int col_begin, int col_end) {
  switch (p.batch) {
    case 1: gemv_typed<T, 1>(p, col_begin, col_end); break;
    case 2: gemv_typed<T, 2>(p, col_begin, col_end); break;
    case 3: gemv_typed<T, 3>(p, col_begin, col_end); break;
    case 4: gemv_typed<T, 4>(p, col_begin, col_end); break;
    case 5: gemv_typed<T, 5>(p, col_begin, col_end); break;
    case 6: gemv_typed<T, 6>(p, col_begin, col_end); break;
    case 7: gemv_typed<T, 7>(p, col_begin, col_end); break;
    default: gemv_typed<T, kGemvMaxRows>(p, col_begin, col_end); break;
  }
}

void gemv_cols(const GemvProblem& p, int col_begin, int col_end) {
  switch (p.w_dtype) {
    case DType::kFloat32: gemv_dispatch<float>(p, col_begin, col_end); break;
    case DType::kBFloat16: gemv_dispatch<BFloat16>(p, col_begin, col_end); break;
    case DType::kFloat16: gemv_dispatch<Float16>(p, col_begin, col_end); break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

}  // namespace
}  // namespace tandem
