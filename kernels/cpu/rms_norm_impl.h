// RMSNorm over rows, written once against the `Isa` struct of the translation unit that includes
// it: out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), the norm in fp32 and rounded to the
// dtype before the weight multiply, as Hugging Face's Llama does. One call normalizes a decode
// step's rows where torch ran four ops and their allocations.
#pragma once

#include <cmath>

#include "dtypes.h"

namespace tandem {
namespace {

template <typename T>
void rms_norm_typed(const T* x, const T* weight, T* out, int rows, int hidden, float eps) {
  using Vec = typename Isa::Vec;
  for (int row = 0; row < rows; ++row) {
    const T* xr = x + static_cast<size_t>(row) * hidden;
    T* outr = out + static_cast<size_t>(row) * hidden;
    Vec squares = Isa::zero();
    for (int i = 0; i < hidden; i += Isa::kWidth) {
      const Vec v = Isa::load(xr + i);
      squares = Isa::fma(v, v, squares);
    }
    const Vec scale = Isa::set1(1.0f / std::sqrt(Isa::reduce_add(squares) / static_cast<float>(hidden) + eps));
    for (int i = 0; i < hidden; i += Isa::kWidth) {
      Isa::store(outr + i, Isa::mul(Isa::load(xr + i), scale));  // rounded to the dtype
      Isa::store(outr + i, Isa::mul(Isa::load(weight + i), Isa::load(outr + i)));
    }
  }
}

void rms_norm_rows(const void* x, const void* weight, void* out, DType dtype, int rows, int hidden, float eps) {
  switch (dtype) {
    case DType::kFloat32:
      rms_norm_typed(static_cast<const float*>(x), static_cast<const float*>(weight), static_cast<float*>(out), rows,
                     hidden, eps);
      break;
    case DType::kBFloat16:
      rms_norm_typed(static_cast<const BFloat16*>(x), static_cast<const BFloat16*>(weight),
                     static_cast<BFloat16*>(out), rows, hidden, eps);
      break;
    case DType::kFloat16:
      rms_norm_typed(static_cast<const Float16*>(x), static_cast<const Float16*>(weight), static_cast<Float16*>(out),
                     rows, hidden, eps);
      break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

}  // namespace
}  // namespace tandem
