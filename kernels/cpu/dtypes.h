// The element types the CPU kernels read and write, shared by the attention and the INT4 matmul.
#pragma once

#include <cstdint>

namespace tandem {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Distinct 16-bit storage types so overloads pick the right conversion.
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

// y [batch, n] = x [batch, k] @ W^T, W [n, k] in w_dtype, x and y fp32 (gemv_impl.h).
struct GemvProblem {
  const float* x;
  const void* w;
  DType w_dtype;
  float* y;
  int batch;  // at most kGemvMaxRows
  int n;
  int k;      // a multiple of the widest vector (16)
};

}  // namespace tandem
