"""Quantizing K/V rows into their slots of a group-quantized pool, in Triton.

The layout is kernels/kv_quant.py's (INT8 symmetric, INT4 asymmetric, GROUP_SIZE channels a
group, fp16 scales and mins after the codes; k8v4's keys INT8 and values INT4, each pool its own
unit size), and the bytes written are exactly those of its
`write_rows`: the scale (and min) rounded to fp16 half to even, codes round-half-even(x / scale)
in fp32 with the fp16-rounded scale and min, a group of zero range getting scale 0 and codes 0.
One program quantizes one (token, KV head): its key row and its value row, every group at once.
`write_quantized` takes any slots: prefill chunks and the decode step's appends (engine/kv/layouts.py's
QuantizedLayout.write on a CUDA pool).

Divisions are tl.math.div_rn (IEEE, as torch divides), not `/`, which compiles to an approximate
division on a GPU. Under Triton's interpreter (TRITON_INTERPRET=1 while this module is imported)
the kernel runs on CPU tensors, which is how tests/kernels/test_triton_kv_quant.py checks its
bytes against write_rows'.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("kernels.triton.kv_quant_write needs the triton package (pyproject's test extra installs "
                      "it)") from exc

from kernels.kv_quant import GROUP_SIZE, check_pools, layout_for, rotate

INTERPRETED: bool = triton.knobs.runtime.interpret
_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SLOT_DTYPES = (torch.int32, torch.int64)

# The layout inside the kernel (jit code may only read globals that are constexpr).
CHANNELS_PER_GROUP = tl.constexpr(GROUP_SIZE)
HALF_GROUP = tl.constexpr(GROUP_SIZE // 2)  # also how far a byte's high nibble channel is from its low one
NIBBLE_BITS = tl.constexpr(4)
BYTE_MASK = tl.constexpr(0xFF)
INT8_LIMIT = tl.constexpr(127.0)
INT4_LIMIT = tl.constexpr(15.0)
# Added to and taken from an fp32 of magnitude < 2**22, it leaves no fraction bits, so the
# addition's own rounding (half to even) rounds the value; Triton has no portable rint.
ROUNDING_SHIFT = tl.constexpr(1.5 * 2 ** 23)

# Reductions through tl.reduce with triton's own combine functions, as kernels/triton/
# paged_prefill.py does: the interpreter reduces with numpy for these (private names of the
# pinned triton), where tl.max/tl.min are jit code it cannot call here.
MAX = tl.standard._elementwise_max
MIN = tl.standard._elementwise_min


@triton.jit
def _divide(a, b):
    """a / b (tensors), IEEE-rounded, broadcast to one shape."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def _codes(x, scale, low, high):
    """round-half-even(x / scale) clamped to [low, high] as int32; 0 where scale is 0 (zero range).
    x [groups, HALF_GROUP] fp32, scale [groups] fp16. Clamping first keeps the rounding trick's
    input small, and gives the same integers (the bounds are integers)."""
    scale = scale.to(tl.float32)[:, None]
    has_range = scale > 0
    ratio = _divide(x, tl.where(has_range, scale, 1.0))
    ratio = tl.minimum(tl.maximum(ratio, low), high)
    rounded = (ratio + ROUNDING_SHIFT) - ROUNDING_SHIFT
    return tl.where(has_range, rounded, 0.0).to(tl.int32)


@triton.jit
def _write_row(row_ptr, codes_ptr, halves_ptr, unit, offset, channel_step, token_step,
               NUM_GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODE_BYTES: tl.constexpr,
               IS_INT4: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Quantize one row into the unit starting at byte `unit`, token slot `offset`: its code of
    code column c at c * channel_step + offset * token_step, scales (then mins) after the codes."""
    group = tl.arange(0, BLOCK_GROUPS)
    half = tl.arange(0, HALF_GROUP)
    group_ok = group < NUM_GROUPS
    ok = group_ok[:, None]
    low_channel = group[:, None] * CHANNELS_PER_GROUP + half[None, :]  # [BLOCK_GROUPS, HALF_GROUP]
    low = tl.load(row_ptr + low_channel, mask=ok, other=0.0).to(tl.float32)
    high = tl.load(row_ptr + low_channel + HALF_GROUP, mask=ok, other=0.0).to(tl.float32)
    scale_at = unit // 2 + CODE_BYTES // 2 + group * BLOCK_SIZE + offset  # in fp16 elements
    if IS_INT4:
        lowest = tl.minimum(tl.reduce(low, 1, MIN), tl.reduce(high, 1, MIN))
        highest = tl.maximum(tl.reduce(low, 1, MAX), tl.reduce(high, 1, MAX))
        scale = _divide(highest - lowest, tl.full([BLOCK_GROUPS], INT4_LIMIT, tl.float32)).to(tl.float16)
        minimum = lowest.to(tl.float16)
        rounded_min = minimum.to(tl.float32)[:, None]
        packed = (_codes(low - rounded_min, scale, 0.0, INT4_LIMIT)
                  | (_codes(high - rounded_min, scale, 0.0, INT4_LIMIT) << NIBBLE_BITS))
        byte_column = group[:, None] * HALF_GROUP + half[None, :]
        tl.store(codes_ptr + unit + byte_column * channel_step + offset * token_step, packed.to(tl.uint8), mask=ok)
        tl.store(halves_ptr + scale_at + NUM_GROUPS * BLOCK_SIZE, minimum, mask=group_ok)
    else:
        absmax = tl.maximum(tl.reduce(tl.abs(low), 1, MAX), tl.reduce(tl.abs(high), 1, MAX))
        scale = _divide(absmax, tl.full([BLOCK_GROUPS], INT8_LIMIT, tl.float32)).to(tl.float16)
        low_at = codes_ptr + unit + low_channel * channel_step + offset * token_step
        # two's complement bytes: the pool is uint8, the codes int8
        tl.store(low_at, (_codes(low, scale, -INT8_LIMIT, INT8_LIMIT) & BYTE_MASK).to(tl.uint8), mask=ok)
        tl.store(low_at + HALF_GROUP * channel_step,
                 (_codes(high, scale, -INT8_LIMIT, INT8_LIMIT) & BYTE_MASK).to(tl.uint8), mask=ok)
    tl.store(halves_ptr + scale_at, scale, mask=group_ok)


@triton.jit
def _write_kernel(key_ptr, value_ptr, key_pool_ptr, key_halves_ptr, value_pool_ptr, value_halves_ptr,
                  blocks_ptr, offsets_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_key_block,
                  stride_key_head, stride_value_block, stride_value_head, NUM_GROUPS: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, K_CODE_BYTES: tl.constexpr, K_IS_INT4: tl.constexpr,
                  V_CODE_COLS: tl.constexpr, V_CODE_BYTES: tl.constexpr, V_IS_INT4: tl.constexpr,
                  BLOCK_GROUPS: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.load(blocks_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    key_unit = block * stride_key_block + kv_head * stride_key_head
    value_unit = block * stride_value_block + kv_head * stride_value_head
    # keys' codes are [code_cols, block_size], values' [block_size, code_cols]
    _write_row(key_ptr + token * stride_kt + kv_head * stride_kh, key_pool_ptr, key_halves_ptr, key_unit, offset,
               BLOCK_SIZE, 1, NUM_GROUPS, BLOCK_SIZE, K_CODE_BYTES, K_IS_INT4, BLOCK_GROUPS)
    _write_row(value_ptr + token * stride_vt + kv_head * stride_vh, value_pool_ptr, value_halves_ptr, value_unit,
               offset, 1, V_CODE_COLS, NUM_GROUPS, BLOCK_SIZE, V_CODE_BYTES, V_IS_INT4, BLOCK_GROUPS)


def write_quantized(key_pool: torch.Tensor, value_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, kv_format: str, block_size: int) -> None:
    """Quantize key and value [num_tokens, kv_heads, head_dim] (fp32, bf16 or fp16) into their
    slots (slot_blocks, slot_offsets [num_tokens] int32 or int64) of one layer's pools
    [num_blocks, kv_heads, unit_bytes] uint8 of format `kv_format` (int8, int4, k8v4). Slot values are
    not checked (that would need a host sync). Raises ValueError on malformed input."""
    num_tokens, num_kv_heads, head_dim = key.shape if key.dim() == 3 else (0, 0, 0)
    layout = layout_for(kv_format, head_dim, block_size)
    _check(key_pool, value_pool, key, value, slot_blocks, slot_offsets, layout)
    if num_tokens == 0:
        return
    key, value = _unit_last(rotate(key.float())), _unit_last(value)  # keys are stored rotated (kv_quant)
    _write_kernel[(num_tokens, num_kv_heads)](
        key, value, key_pool, key_pool.view(torch.float16), value_pool, value_pool.view(torch.float16),
        slot_blocks.contiguous(), slot_offsets.contiguous(), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1),
        NUM_GROUPS=layout.key.num_groups, BLOCK_SIZE=block_size, K_CODE_BYTES=layout.key.code_bytes,
        K_IS_INT4=layout.key.bits == 4, V_CODE_COLS=layout.value.code_cols, V_CODE_BYTES=layout.value.code_bytes,
        V_IS_INT4=layout.value.bits == 4, BLOCK_GROUPS=triton.next_power_of_2(layout.key.num_groups))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous (a view of a fused QKV stays a view)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(key_pool, value_pool, key, value, slot_blocks, slot_offsets, layout) -> None:
    if key.dim() != 3 or tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"key and value must be [num_tokens, kv_heads, head_dim] alike, got {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if key.dtype not in _ROW_DTYPES or value.dtype not in _ROW_DTYPES:
        raise ValueError(f"key and value must be fp32, bf16 or fp16, got {key.dtype}, {value.dtype}")
    num_tokens, num_kv_heads, _ = key.shape
    if check_pools(key_pool, value_pool, layout) != num_kv_heads:
        raise ValueError(f"the pools hold {key_pool.shape[1]} KV heads, the rows {num_kv_heads}")
    for name, slots in (("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        if slots.dtype not in _SLOT_DTYPES or tuple(slots.shape) != (num_tokens,):
            raise ValueError(f"{name} must be int32 or int64 [{num_tokens}], got {slots.dtype} {tuple(slots.shape)}")
    devices = {t.device for t in (key_pool, value_pool, key, value, slot_blocks, slot_offsets)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
