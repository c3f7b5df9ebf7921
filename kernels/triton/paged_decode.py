"""Paged decode attention on CUDA, in Triton: one new query token per sequence over its paged K/V.

The caches are the layout every tandem decode backend reads (engine/attention/decode.py): values
[num_blocks, kv_heads, block_size, head_dim], keys transposed within a block [num_blocks,
kv_heads, head_dim, block_size]. One program attends one (sequence, KV head): the query heads of
its GQA group together (each K/V block is read once for the group), block after block of the
sequence's table with a running softmax in fp32 (max, sum, accumulator), so no score matrix is
ever stored. Scores and the value sum are tl.dot products when the tiles are large enough for
them (block size >= 16), else broadcast products summed in registers. The new token's K/V is
written into its slot first (indexed stores, no host sync), as the other backends do.

With `kv_format` (int8, int4, k8v4) the caches are group-quantized pools, kernels/kv_quant.py's
layout (the new token quantized in by kernels/triton/kv_quant_write.py), each pool with its own
codes and unit size (k8v4: INT8 keys, INT4 values): a second kernel reads the
codes and each token's group scales (and mins), dequantizes them in registers and runs the same
softmax; no dequantized copy is ever stored. It splits the head dim into the low and the high
half of every group, the channels an INT4 byte's two nibbles hold, so that a packed tile widens
into two tiles with no reordering: scores are the sum of the halves' dots and the output has a
low and a high half (INT8 is split the same way, one code path).

On a GPU the dot inputs stay in the cache dtype (bf16/fp16 on the tensor cores, fp32 as IEEE
fp32, not TF32; over a quantized pool, the query's dtype); under Triton's interpreter
(TRITON_INTERPRET=1 while this module is imported) the kernels run on CPU tensors in fp32
throughout, which is how CI tests them (tests/kernels/test_triton_paged_decode.py,
test_triton_kv_quant.py). No autotuning: the tile shapes follow the model (head_dim, group size,
block size).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("kernels.triton.paged_decode needs the triton package (pyproject's test extra installs "
                      "it)") from exc

from kernels.kv_quant import GROUP_SIZE, FormatLayout, check_pools, layout_for, rotate

INTERPRETED: bool = triton.knobs.runtime.interpret
MIN_DOT = 16  # tl.dot's smallest tile side
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
NEG_INF = tl.constexpr(float("-inf"))
# kernels/kv_quant.py's layout inside the kernels (jit code may only read globals that are constexpr)
CHANNELS_PER_GROUP = tl.constexpr(GROUP_SIZE)
HALF_GROUP = tl.constexpr(GROUP_SIZE // 2)  # how far a byte's high nibble channel is from its low one
LOW_NIBBLE = tl.constexpr(0xF)
NIBBLE_BITS = tl.constexpr(4)


# Reductions through tl.reduce with combine functions of this module: triton.language's own
# tl.sum/tl.max/tl.cdiv are @triton.jit code decorated when triton was imported, which Triton's
# interpreter cannot call unless triton itself was imported under it (the tests switch the
# interpreter on for this module alone: tests/conftest.py).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _scores(q, k, FP32_DOT: tl.constexpr):
    """q [G, D] . k [D, T] -> [G, T] fp32. Always tl.dot (tiles are at least MIN_DOT wide, a small
    block's tail masked): a broadcast-and-reduce variant, once used for blocks under 16 tokens, was
    off by up to 5e-3 on an H100 (Triton 3.6) where it passed under the interpreter."""
    if FP32_DOT:
        return tl.dot(q, k, input_precision="ieee")
    return tl.dot(q, k)


@triton.jit
def _weighted_values(p, v, FP32_DOT: tl.constexpr):
    """p [G, T] fp32 . v [T, D] -> [G, D] fp32 (p rounded to v's dtype for the tensor cores)."""
    if FP32_DOT:
        return tl.dot(p, v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vt,
                         stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                         COMPUTE: tl.constexpr, FP32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BLOCK_T)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = (q.to(tl.float32) * scale).to(COMPUTE)
    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    for b in range(0, (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        t_ok = (t < BLOCK_SIZE) & (b * BLOCK_SIZE + t < context_len)
        k = tl.load(k_ptr + block * stride_kb + kv_head * stride_kh + d[:, None] * stride_kd + t[None, :],
                    mask=d_ok[:, None] & t_ok[None, :], other=0.0).to(COMPUTE)
        s = tl.where(t_ok[None, :], _scores(q, k, FP32_DOT), NEG_INF)
        new_max = tl.maximum(row_max, tl.reduce(s, 1, _larger))
        p = tl.exp(s - new_max[:, None])
        correction = tl.exp(row_max - new_max)
        row_sum = row_sum * correction + tl.reduce(p, 1, _add)
        v = tl.load(v_ptr + block * stride_vb + kv_head * stride_vh + t[:, None] * stride_vt + d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
        acc = acc * correction[:, None] + _weighted_values(p, v, FP32_DOT)
        row_max = new_max
    out = tl.where(row_sum[:, None] > 0, acc / tl.maximum(row_sum, 1e-30)[:, None], 0.0)  # empty context: zeros
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _dequantized_halves(codes_ptr, halves_ptr, low_at, high_at, scale_at, mask, MINS_AFTER: tl.constexpr,
                        IS_INT4: tl.constexpr, COMPUTE: tl.constexpr):
    """One tile of a unit as (low halves, high halves) of its groups' channels, code * scale (+ min)
    in fp32, then COMPUTE. low_at, high_at: byte offsets of the codes (INT4: one packed byte holds
    both, high_at unused); scale_at: fp16 offsets of the scales, the mins MINS_AFTER further."""
    if IS_INT4:
        packed = tl.load(codes_ptr + low_at, mask=mask, other=0)
        low = (packed & LOW_NIBBLE).to(tl.float32)
        high = (packed >> NIBBLE_BITS).to(tl.float32)
    else:
        low = tl.load(codes_ptr + low_at, mask=mask, other=0).to(tl.float32)
        high = tl.load(codes_ptr + high_at, mask=mask, other=0).to(tl.float32)
    scale = tl.load(halves_ptr + scale_at, mask=mask, other=0.0).to(tl.float32)
    low, high = low * scale, high * scale
    if IS_INT4:
        minimum = tl.load(halves_ptr + scale_at + MINS_AFTER, mask=mask, other=0.0).to(tl.float32)
        low, high = low + minimum, high + minimum
    return low.to(COMPUTE), high.to(COMPUTE)


@triton.jit
def _code_columns(h, low_channel, IS_INT4: tl.constexpr):
    """The code columns of each channel pair (low, high half of its group): INT4's one byte column
    holds both."""
    if IS_INT4:
        low_column = h
        high_column = h
    else:
        low_column = low_channel
        high_column = low_channel + HALF_GROUP
    return low_column, high_column


@triton.jit
def _paged_decode_quantized_kernel(q_ptr, key_codes_ptr, key_halves_ptr, value_codes_ptr, value_halves_ptr, out_ptr,
                                   tables_ptr, lens_ptr, scale, stride_qb, stride_qh, stride_key_block,
                                   stride_key_head, stride_value_block, stride_value_head, stride_tb, stride_ob,
                                   stride_oh, GROUP: tl.constexpr, HALF_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                   K_SCALES_AT: tl.constexpr, K_MINS_AFTER: tl.constexpr, K_IS_INT4: tl.constexpr,
                                   V_CODE_COLS: tl.constexpr, V_SCALES_AT: tl.constexpr, V_MINS_AFTER: tl.constexpr,
                                   V_IS_INT4: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr,
                                   BLOCK_T: tl.constexpr, COMPUTE: tl.constexpr, FP32_DOT: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    h = tl.arange(0, BLOCK_H)  # a channel of the low half of its group; h + HALF_GROUP's is the high one
    t = tl.arange(0, BLOCK_T)
    g_ok = g < GROUP
    h_ok = h < HALF_DIM
    heads = kv_head * GROUP + g
    low_channel = (h // HALF_GROUP) * CHANNELS_PER_GROUP + h % HALF_GROUP
    q_at = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + low_channel[None, :]
    q_mask = g_ok[:, None] & h_ok[None, :]
    q_low = (tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32) * scale).to(COMPUTE)
    q_high = (tl.load(q_at + HALF_GROUP, mask=q_mask, other=0.0).to(tl.float32) * scale).to(COMPUTE)
    k_low_column, k_high_column = _code_columns(h, low_channel, K_IS_INT4)
    v_low_column, v_high_column = _code_columns(h, low_channel, V_IS_INT4)
    group_row = (h // HALF_GROUP) * BLOCK_SIZE  # fp16 offset of each channel's group scales in the scales
    k_scale_row = K_SCALES_AT + group_row
    v_scale_row = V_SCALES_AT + group_row
    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_G], 0.0, tl.float32)
    acc_low = tl.full([BLOCK_G, BLOCK_H], 0.0, tl.float32)
    acc_high = tl.full([BLOCK_G, BLOCK_H], 0.0, tl.float32)
    for b in range(0, (context_len + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + b).to(tl.int64)
        # bytes; the fp16 views' offsets are half
        key_unit = block * stride_key_block + kv_head * stride_key_head
        value_unit = block * stride_value_block + kv_head * stride_value_head
        t_ok = (t < BLOCK_SIZE) & (b * BLOCK_SIZE + t < context_len)
        # keys' codes [code_cols, block_size]: a [BLOCK_H, BLOCK_T] tile
        k_low, k_high = _dequantized_halves(key_codes_ptr + key_unit, key_halves_ptr + key_unit // 2,
                                            k_low_column[:, None] * BLOCK_SIZE + t[None, :],
                                            k_high_column[:, None] * BLOCK_SIZE + t[None, :],
                                            k_scale_row[:, None] + t[None, :], h_ok[:, None] & t_ok[None, :],
                                            K_MINS_AFTER, K_IS_INT4, COMPUTE)
        s = _scores(q_low, k_low, FP32_DOT) + _scores(q_high, k_high, FP32_DOT)
        s = tl.where(t_ok[None, :], s, NEG_INF)
        new_max = tl.maximum(row_max, tl.reduce(s, 1, _larger))
        p = tl.exp(s - new_max[:, None])
        correction = tl.exp(row_max - new_max)
        row_sum = row_sum * correction + tl.reduce(p, 1, _add)
        # values' codes [block_size, code_cols]: a [BLOCK_T, BLOCK_H] tile
        v_low, v_high = _dequantized_halves(value_codes_ptr + value_unit, value_halves_ptr + value_unit // 2,
                                            t[:, None] * V_CODE_COLS + v_low_column[None, :],
                                            t[:, None] * V_CODE_COLS + v_high_column[None, :],
                                            v_scale_row[None, :] + t[:, None], t_ok[:, None] & h_ok[None, :],
                                            V_MINS_AFTER, V_IS_INT4, COMPUTE)
        acc_low = acc_low * correction[:, None] + _weighted_values(p, v_low, FP32_DOT)
        acc_high = acc_high * correction[:, None] + _weighted_values(p, v_high, FP32_DOT)
        row_max = new_max
    inverse_sum = tl.where(row_sum > 0, 1.0 / tl.maximum(row_sum, 1e-30), 0.0)  # empty context: zeros
    out_at = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + low_channel[None, :]
    tl.store(out_at, (acc_low * inverse_sum[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(out_at + HALF_GROUP, (acc_high * inverse_sum[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


def side_constants(layout: FormatLayout) -> dict[str, int | bool]:
    """Where each pool's unit parts lie, as the quantized kernels' K_* and V_* constexprs (fp16
    offsets, value code columns), for the prefill kernel too."""
    return dict(K_SCALES_AT=layout.key.code_bytes // 2, K_MINS_AFTER=layout.key.scale_bytes // 2,
                K_IS_INT4=layout.key.bits == 4, V_CODE_COLS=layout.value.code_cols,
                V_SCALES_AT=layout.value.code_bytes // 2, V_MINS_AFTER=layout.value.scale_bytes // 2,
                V_IS_INT4=layout.value.bits == 4)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           kv_format: str | None = None, block_size: int | None = None) -> torch.Tensor:
    """query [batch, heads, head_dim]; caches as above; block_tables [batch, max_blocks] int32;
    context_lens [batch] int32 -> out [batch, heads, head_dim] in the query's dtype. The new
    token's K/V must already be in the caches. With `kv_format` (int8, int4, k8v4) the caches are
    group-quantized pools [num_blocks, kv_heads, unit_bytes] uint8 of kernels/kv_quant.py's
    layout, `block_size` tokens a block (not in their shape). Raises ValueError on malformed input."""
    if kv_format is not None:
        return _quantized_decode(query, key_cache, value_cache, block_tables, context_lens, scale, kv_format,
                                 block_size)
    _check(query, key_cache, value_cache, block_tables, context_lens)
    batch, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = value_cache.shape
    group = num_heads // num_kv_heads
    query, block_tables, context_lens = query.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(query)
    if batch == 0:
        return out
    cache_dtype = value_cache.dtype
    compute = tl.float32 if INTERPRETED else _TL_DTYPES[cache_dtype]
    _paged_decode_kernel[(batch, num_kv_heads)](
        query, key_cache, value_cache, out, block_tables, context_lens, float(scale),
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=_tile(group), BLOCK_D=_tile(head_dim),
        BLOCK_T=_tile(block_size), COMPUTE=compute, FP32_DOT=INTERPRETED or cache_dtype == torch.float32)
    return out


def _check(query, key_cache, value_cache, block_tables, context_lens) -> None:
    if query.dim() != 3 or value_cache.dim() != 4 or key_cache.dim() != 4:
        raise ValueError(f"query must be [batch, heads, head_dim] and the caches 4-D, got {tuple(query.shape)}, "
                         f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_blocks, num_kv_heads, block_size, head_dim = value_cache.shape
    if tuple(key_cache.shape) != (num_blocks, num_kv_heads, head_dim, block_size):
        raise ValueError(f"key_cache must be [blocks, kv_heads, head_dim, block_size] = "
                         f"{(num_blocks, num_kv_heads, head_dim, block_size)}, got {tuple(key_cache.shape)}")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    _check_query(query, num_kv_heads, head_dim, block_tables, context_lens)
    if query.dtype not in _TL_DTYPES or value_cache.dtype not in _TL_DTYPES or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"dtypes must be fp32, bf16 or fp16 (caches alike), got {query.dtype}, "
                         f"{key_cache.dtype}, {value_cache.dtype}")


def _check_query(query, num_kv_heads: int, head_dim: int, block_tables, context_lens) -> None:
    if query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit {num_kv_heads} KV heads of {head_dim}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError("block_tables and context_lens must be int32")
    if block_tables.shape[0] != query.shape[0] or tuple(context_lens.shape) != (query.shape[0],):
        raise ValueError("block_tables and context_lens must have one row per query")


def _quantized_decode(query, key_pool, value_pool, block_tables, context_lens, scale: float, kv_format: str,
                      block_size: int | None) -> torch.Tensor:
    """paged_decode_attention over group-quantized pools."""
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, heads, head_dim], got {tuple(query.shape)}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"a {kv_format} KV cache needs its block_size, got {block_size!r}")
    batch, num_heads, head_dim = query.shape
    layout = layout_for(kv_format, head_dim, block_size)
    num_kv_heads = check_pools(key_pool, value_pool, layout)
    _check_query(query, num_kv_heads, head_dim, block_tables, context_lens)
    if query.dtype not in _TL_DTYPES:
        raise ValueError(f"query must be fp32, bf16 or fp16, got {query.dtype}")
    query = rotate(query.float()).to(query.dtype)  # meets the rotated keys (kv_quant)
    query, block_tables, context_lens = query.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(query)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_quantized_kernel[(batch, num_kv_heads)](
        query, key_pool.view(layout.key.code_dtype), key_pool.view(torch.float16),
        value_pool.view(layout.value.code_dtype), value_pool.view(torch.float16), out, block_tables, context_lens,
        float(scale), query.stride(0), query.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0),
        value_pool.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HALF_DIM=head_dim // 2, BLOCK_SIZE=block_size, **side_constants(layout),
        BLOCK_G=_tile(group), BLOCK_H=_tile(head_dim // 2), BLOCK_T=_tile(block_size),
        COMPUTE=tl.float32 if INTERPRETED else _TL_DTYPES[query.dtype],
        FP32_DOT=INTERPRETED or query.dtype == torch.float32)
    return out
