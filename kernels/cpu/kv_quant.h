// The group-quantized KV unit in C++ (kernels/kv_quant.py is the spec): where the parts of one
// (block, kv head) unit lie, shared by the fused append, the attention and the decoder, and the
// quantization of one token's row that the fused append writes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "half.h"

namespace tandem {

constexpr int kQuantGroup = 64;  // channels sharing one scale (and min): kv_quant.GROUP_SIZE
constexpr float kHadamardNorm = 0.125f;  // 1 / sqrt(kQuantGroup): H is orthonormal, its own inverse
// A quantized pool's block_size must be a multiple of this: the widest vector of scales (16 fp16
// tokens) then never straddles a unit's end.
constexpr int kQuantBlockMultiple = 16;
constexpr int kInt8MaxCode = 127;
constexpr int kInt4MaxCode = 15;
constexpr float kNibbleWeight = 16.0f;  // a packed INT4 byte = low nibble + 16 * high nibble

// One (block, kv head) unit of a KV pool. Dense: [head_dim, block_size] (keys) or [block_size,
// head_dim] (values) elements. Quantized: codes (keys [code_cols, block_size], values
// [block_size, code_cols]), then fp16 scales [num_groups, block_size], then (INT4) fp16 mins.
struct KvUnit {
  DType dtype;
  int head_dim;
  int block_size;

  bool quantized() const { return is_quantized(dtype); }
  bool has_min() const { return dtype == DType::kInt4; }
  int num_groups() const { return head_dim / kQuantGroup; }
  // Bytes of one token's codes of one group: INT4 packs two channels a byte.
  int group_code_bytes() const { return dtype == DType::kInt4 ? kQuantGroup / 2 : kQuantGroup; }
  size_t code_cols() const { return static_cast<size_t>(num_groups()) * group_code_bytes(); }
  size_t code_bytes() const { return code_cols() * block_size; }
  size_t scale_bytes() const { return static_cast<size_t>(num_groups()) * block_size * sizeof(uint16_t); }
  size_t scales_offset() const { return code_bytes(); }
  size_t mins_offset() const { return code_bytes() + scale_bytes(); }
  size_t bytes() const {
    if (!quantized()) return static_cast<size_t>(head_dim) * block_size * dtype_size(dtype);
    return code_bytes() + scale_bytes() * (has_min() ? 2 : 1);
  }
};

// x [kQuantGroup] times H, Sylvester's Hadamard matrix / sqrt(kQuantGroup), in place: the keys'
// rotation (kernels/kv_quant.py: rotate). The butterflies run in kv_quant.rotate's order, so both
// give the same bits.
inline void hadamard_rotate(float* x) {
  for (int h = 1; h < kQuantGroup; h *= 2) {
    for (int i = 0; i < kQuantGroup; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  for (int i = 0; i < kQuantGroup; ++i) x[i] *= kHadamardNorm;
}

// A group's codes as kv_quant.quantize makes them: x / scale rounded half to even in fp32, with
// the fp16-rounded scale (and min); a group of zero range gets codes 0. INT8 codes are stored
// as their two's-complement bytes, INT4 codes in [0, 15], one a byte, natural order.
inline void quantize_group(const float* x, bool int4, uint8_t* codes, uint16_t* scale, uint16_t* min) {
  float low = x[0], high = x[0], absmax = 0.0f;
  for (int i = 0; i < kQuantGroup; ++i) {
    low = std::min(low, x[i]);
    high = std::max(high, x[i]);
    absmax = std::max(absmax, std::fabs(x[i]));
  }
  *scale = float_to_half(int4 ? (high - low) / kInt4MaxCode : absmax / kInt8MaxCode);
  *min = float_to_half(low + 0.0f);  // -0 becomes +0, as in kv_quant.quantize
  const float step = half_to_float(*scale);
  const float offset = int4 ? half_to_float(*min) : 0.0f;
  const float lowest = int4 ? 0.0f : -kInt8MaxCode;
  const float highest = int4 ? kInt4MaxCode : kInt8MaxCode;
  for (int i = 0; i < kQuantGroup; ++i) {
    const float code = step > 0 ? std::nearbyint((x[i] - offset) / step) : 0.0f;
    codes[i] = static_cast<uint8_t>(static_cast<int8_t>(std::min(std::max(code, lowest), highest)));
  }
}

// Quantizes one token's row x [head_dim] (fp32) into slot `offset` of `unit` (layout `u`): its
// codes into the key or value code layout, its scales (and mins) into their [num_groups,
// block_size] rows.
inline void write_quantized_token(const KvUnit& u, bool is_key, const float* x, int offset, uint8_t* unit) {
  const int half = kQuantGroup / 2;
  for (int g = 0; g < u.num_groups(); ++g) {
    uint8_t codes[kQuantGroup];
    uint16_t scale, min;
    float group[kQuantGroup];
    std::memcpy(group, x + g * kQuantGroup, sizeof(group));
    if (is_key) hadamard_rotate(group);  // keys are stored rotated
    quantize_group(group, u.has_min(), codes, &scale, &min);
    const size_t slot = static_cast<size_t>(g) * u.block_size + offset;
    std::memcpy(unit + u.scales_offset() + slot * sizeof(uint16_t), &scale, sizeof(scale));
    if (u.has_min()) std::memcpy(unit + u.mins_offset() + slot * sizeof(uint16_t), &min, sizeof(min));
    for (int j = 0; j < u.group_code_bytes(); ++j) {
      // INT4: byte j holds channel j (low nibble) and channel j + 32 (high), kv_quant.pack_nibbles
      const uint8_t byte = u.has_min() ? static_cast<uint8_t>(codes[j] | codes[j + half] << 4) : codes[j];
      const size_t column = static_cast<size_t>(g) * u.group_code_bytes() + j;
      unit[is_key ? column * u.block_size + offset : offset * u.code_cols() + column] = byte;
    }
  }
}

}  // namespace tandem
