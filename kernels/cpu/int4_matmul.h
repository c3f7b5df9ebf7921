// Entry points of the INT4 matmul (int4.h): validate, quantize x, split the work over the thread
// pool. Tensors arrive as raw pointers (kernels/cpu/int4.py checks dtypes and shapes); bad sizes
// throw std::invalid_argument, which the Python binding turns into ValueError.
#pragma once

#include <cstdint>
#include <string>

namespace tandem {

// y [batch, n] = x [batch, k] @ W^T with x quantized to int8 per block of 32 (any batch: rows are
// register-blocked and cache-tiled, the weight is never widened). `dtype` is x's and y's DType.
void int4_linear(uintptr_t x, uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t y, int dtype, int batch,
                 int n, int k, int group_size, int num_threads, const std::string& isa);

// The same product with x quantized to int16 (about 1e-4 relative error): decode's, where the
// weight's bytes, not the multiplies, set the time.
void int4_linear_int16(uintptr_t x, uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t y, int dtype,
                       int batch, int n, int k, int group_size, int num_threads, const std::string& isa);

// Rows of W written densely into out [n, k] in `out_dtype`.
void int4_dequantize(uintptr_t codes, uintptr_t scales, uintptr_t mins, uintptr_t out, int out_dtype, int n,
                     int k, int group_size, int num_threads, const std::string& isa);

}  // namespace tandem
