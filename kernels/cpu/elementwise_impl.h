// The decoder layer's elementwise glue (residual adds, SwiGLU's silu(gate) * up, dtype
// conversions), written once against the `Isa` struct of the translation unit that includes it.
// Each result is rounded to the dtype where torch's op would round it, so the C++ decoder
// (decoder.h) computes what the model's torch ops compute: an add in fp32 then rounded; silu as
// x / (1 + e^-x) rounded, then the product with up rounded. Counts are multiples of 16.
#pragma once

#include <cstddef>

#include "dtypes.h"

namespace tandem {
namespace {

template <typename T>
void add_rows_typed(const T* a, const T* b, T* out, int rows, int cols, int b_rows) {
  for (int row = 0; row < rows; ++row) {
    const size_t offset = static_cast<size_t>(row) * cols;
    const T* br = b + (b_rows == 1 ? 0 : offset);
    for (int i = 0; i < cols; i += Isa::kWidth) {
      Isa::store(out + offset + i, Isa::add(Isa::load(a + offset + i), Isa::load(br + i)));
    }
  }
}

void add_rows(const void* a, const void* b, void* out, DType dtype, int rows, int cols, int b_rows) {
  switch (dtype) {
    case DType::kFloat32:
      add_rows_typed(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(out), rows, cols,
                     b_rows);
      break;
    case DType::kBFloat16:
      add_rows_typed(static_cast<const BFloat16*>(a), static_cast<const BFloat16*>(b), static_cast<BFloat16*>(out),
                     rows, cols, b_rows);
      break;
    case DType::kFloat16:
      add_rows_typed(static_cast<const Float16*>(a), static_cast<const Float16*>(b), static_cast<Float16*>(out),
                     rows, cols, b_rows);
      break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

template <typename T>
void silu_mul_typed(const T* gate_up, T* out, int rows, int width) {
  using Vec = typename Isa::Vec;
  const Vec one = Isa::set1(1.0f);
  const Vec zero = Isa::zero();
  alignas(64) T rounded[Isa::kWidth];  // silu(gate) in the dtype, as torch's F.silu returns it
  for (int row = 0; row < rows; ++row) {
    const T* gate = gate_up + static_cast<size_t>(row) * 2 * width;
    const T* up = gate + width;
    T* outr = out + static_cast<size_t>(row) * width;
    for (int i = 0; i < width; i += Isa::kWidth) {
      const Vec g = Isa::load(gate + i);
      Isa::store(rounded, Isa::div(g, Isa::add(one, Isa::exp(Isa::sub(zero, g)))));
      Isa::store(outr + i, Isa::mul(Isa::load(rounded), Isa::load(up + i)));
    }
  }
}

void silu_mul_rows(const void* gate_up, void* out, DType dtype, int rows, int width) {
  switch (dtype) {
    case DType::kFloat32:
      silu_mul_typed(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, width);
      break;
    case DType::kBFloat16:
      silu_mul_typed(static_cast<const BFloat16*>(gate_up), static_cast<BFloat16*>(out), rows, width);
      break;
    case DType::kFloat16:
      silu_mul_typed(static_cast<const Float16*>(gate_up), static_cast<Float16*>(out), rows, width);
      break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

template <typename From, typename To>
void convert_typed(const From* x, To* out, size_t count) {
  for (size_t i = 0; i < count; i += Isa::kWidth) Isa::store(out + i, Isa::load(x + i));
}

template <typename From>
void convert_from(const From* x, void* out, DType to, size_t count) {
  switch (to) {
    case DType::kFloat32: convert_typed(x, static_cast<float*>(out), count); break;
    case DType::kBFloat16: convert_typed(x, static_cast<BFloat16*>(out), count); break;
    case DType::kFloat16: convert_typed(x, static_cast<Float16*>(out), count); break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

void convert(const void* x, DType from, void* out, DType to, size_t count) {
  switch (from) {
    case DType::kFloat32: convert_from(static_cast<const float*>(x), out, to, count); break;
    case DType::kBFloat16: convert_from(static_cast<const BFloat16*>(x), out, to, count); break;
    case DType::kFloat16: convert_from(static_cast<const Float16*>(x), out, to, count); break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

}  // namespace
}  // namespace tandem
