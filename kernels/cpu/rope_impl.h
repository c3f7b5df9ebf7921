// Rotary position embedding (rotate-half, Hugging Face's Llama convention), written once against
// the `Isa` struct of the translation unit that includes it: for each token's heads,
//   out[i] = x[i] cos[i] - x[i + half] sin[i],  out[i + half] = x[i + half] cos[i + half] + x[i] sin[i + half],
// in fp32 (each product rounded, then the sum, as torch's ops do) and stored in the dtype. One call
// rotates a step's Q and K heads where torch ran a gather, a concatenation and four arithmetic ops.
#pragma once

#include "dtypes.h"

namespace tandem {
namespace {

template <typename T>
void rope_typed(const T* x, T* out, const int64_t* positions, const float* cos, const float* sin, int tokens,
                int heads, int head_dim) {
  const int half = head_dim / 2;
  for (int t = 0; t < tokens; ++t) {
    const float* c = cos + positions[t] * head_dim;
    const float* s = sin + positions[t] * head_dim;
    for (int h = 0; h < heads; ++h) {
      const size_t base = (static_cast<size_t>(t) * heads + h) * head_dim;
      for (int i = 0; i < half; i += Isa::kWidth) {
        const auto low = Isa::load(x + base + i);
        const auto high = Isa::load(x + base + half + i);
        Isa::store(out + base + i, Isa::sub(Isa::mul(low, Isa::load(c + i)), Isa::mul(high, Isa::load(s + i))));
        Isa::store(out + base + half + i,
                   Isa::add(Isa::mul(high, Isa::load(c + half + i)), Isa::mul(low, Isa::load(s + half + i))));
      }
    }
  }
}

void rope_rows(const void* x, void* out, DType dtype, const int64_t* positions, const float* cos, const float* sin,
               int tokens, int heads, int head_dim) {
  switch (dtype) {
    case DType::kFloat32:
      rope_typed(static_cast<const float*>(x), static_cast<float*>(out), positions, cos, sin, tokens, heads, head_dim);
      break;
    case DType::kBFloat16:
      rope_typed(static_cast<const BFloat16*>(x), static_cast<BFloat16*>(out), positions, cos, sin, tokens, heads,
                 head_dim);
      break;
    case DType::kFloat16:
      rope_typed(static_cast<const Float16*>(x), static_cast<Float16*>(out), positions, cos, sin, tokens, heads,
                 head_dim);
      break;
    case DType::kInt8:
    case DType::kInt4:
    case DType::kK8V4: break;  // KV cache formats, never a compute dtype
  }
}

}  // namespace
}  // namespace tandem
