// The element types the CPU kernels read and write, shared by the attention and the INT4 matmul.
#pragma once

#include <cstdint>

namespace tandem {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Distinct 16-bit storage types so overloads pick the right conversion.
struct BFloat16 { uint16_t bits; };
struct Float16 { uint16_t bits; };

}  // namespace tandem
