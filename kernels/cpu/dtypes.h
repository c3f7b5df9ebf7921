// The element types the CPU kernels read and write, shared by the attention and the INT4 matmul.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tandem {

// kInt8, kInt4 and kK8V4 (INT8 keys, INT4 values) are KV cache formats only (group-quantized units,
// kv_quant.h); the codes match kernels.kv_quant.FORMAT_CODES.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kInt4 = 4, kK8V4 = 5 };

inline bool is_quantized(DType dtype) {
  return dtype == DType::kInt8 || dtype == DType::kInt4 || dtype == DType::kK8V4;
}

// The unit dtype of a KV format's key and value pools: a format names both, K8V4 two different ones.
inline DType key_unit_dtype(DType format) { return format == DType::kK8V4 ? DType::kInt8 : format; }
inline DType value_unit_dtype(DType format) { return format == DType::kK8V4 ? DType::kInt4 : format; }

// Bytes of one element of a float dtype.
inline size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Distinct 16-bit storage types so overloads pick the right conversion.
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

// Up to this many rows of x share each pass over W (gemv_impl.h): a decode step's, and the verify
// rows of a speculative decode.
constexpr int kGemvMaxRows = 8;

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
