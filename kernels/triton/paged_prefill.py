"""Paged prefill attention on CUDA, in Triton: chunks of new tokens over a cached prefix.

Chunked prefill and prefix caching compute a sequence's tokens at positions [num_cached,
num_cached + query_len) while the K/V of [0, num_cached) is already in the paged cache. Each
chunk's query rows attend to the whole cached prefix and causally to the chunk's own rows. The
chunk's own K/V is read from the k/v tensors, never from the cache, so the caller may write the
chunk into the cache before or after this kernel.

The caches are the layout of kernels/triton/paged_decode.py: values [num_blocks, num_kv_heads,
block_size, head_dim], keys transposed within a block [num_blocks, num_kv_heads, head_dim,
block_size]. One program computes one tile of a chunk's query rows for one KV head: the tile's
tokens times the query heads of the GQA group, so that each K/V tile is read once for the group.
It walks key tiles of the cached prefix (each key's block looked up in the table, so the key tile
need not match the block size), then the chunk's own key tiles up to the causal diagonal, with a
running softmax in fp32 (max, sum, accumulator): no score matrix is ever stored. Every tile side
is at least tl.dot's 16, so scores and value sums are always tl.dot products.

Packed chunks are ragged, and the grid is sized from the tensors' shapes alone (no host sync):
it has num_tokens // BLOCK_Q + num_seqs query tiles, an upper bound on the chunks' tiles, and
each program finds its chunk by a binary search of query_start; programs past their chunk's end
return at once.

With `kv_format` (int8, int4, k8v4) the caches are group-quantized pools, kernels/kv_quant.py's
layout (each pool its own codes: k8v4's keys INT8, values INT4): a second kernel reads the
prefix's codes and each token's group scales (and mins), dequantizes
them in registers and runs the same softmax (no dequantized copy is stored). As in
kernels/triton/paged_decode.py's quantized kernel, the head dim is split into the low and the
high half of every group, the channels an INT4 byte's two nibbles hold, for queries, keys,
values (the chunk's dense ones too) and the output alike.

On a GPU the dot inputs stay in the cache dtype (bf16/fp16 on the tensor cores, fp32 as IEEE
fp32, not TF32; over a quantized pool, q's dtype); under Triton's interpreter (TRITON_INTERPRET=1
while this module is imported) the kernels run on CPU tensors in fp32 throughout, which is how
CI tests them (tests/kernels/test_triton_paged_prefill.py, test_triton_kv_quant.py). No
autotuning: the tile shapes follow the model (head_dim, group size).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError("kernels.triton.paged_prefill needs the triton package (pyproject's test extra installs "
                      "it)") from exc

from kernels.kv_quant import GROUP_SIZE, check_pools, layout_for, rotate
from kernels.triton.paged_decode import _code_columns, _dequantized_halves, side_constants

INTERPRETED: bool = triton.knobs.runtime.interpret
MIN_DOT = 16  # tl.dot's smallest tile side
ROWS_PER_TILE = 64  # query rows (tokens x group heads) per program: a tensor-core M tile
KEYS_PER_TILE = 32  # keys per step of the running softmax
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
NEG_INF = tl.constexpr(float("-inf"))
# kernels/kv_quant.py's layout inside the kernels (jit code may only read globals that are constexpr)
CHANNELS_PER_GROUP = tl.constexpr(GROUP_SIZE)
HALF_GROUP = tl.constexpr(GROUP_SIZE // 2)  # how far a byte's high nibble channel is from its low one
LOW_NIBBLE = tl.constexpr(0xF)
NIBBLE_BITS = tl.constexpr(4)


# Reductions through tl.reduce with triton's own combine functions, not tl.sum/tl.max: those are
# @triton.jit code that Triton's interpreter cannot call unless triton itself was imported under
# it (the tests switch the interpreter on for this module alone: tests/conftest.py). For these two
# combine functions the interpreter reduces with numpy; with combine functions of this module
# (paged_decode.py's way) it calls them once per element, which is minutes for a prefill's
# [rows, keys] tiles. They are private names of the pinned triton (pyproject.toml).
SUM = tl.standard._sum_combine
MAX = tl.standard._elementwise_max


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _softmax_step(q, k, v, allowed, scale, row_max, row_sum, acc, FP32_DOT: tl.constexpr):
    """One key tile into the running softmax: q [M, D], k [D, N], v [N, D], allowed [M or 1, N].
    Every row has an allowed key in the first tile it sees (the prefix's first or the chunk's
    first), so row_max is finite after it and no -inf - -inf arises."""
    s = tl.where(allowed, _dot(q, k, FP32_DOT) * scale, NEG_INF)  # [M, N] fp32
    new_max = tl.maximum(row_max, tl.reduce(s, 1, MAX))
    p = tl.exp(s - new_max[:, None])
    correction = tl.exp(row_max - new_max)
    row_sum = row_sum * correction + tl.reduce(p, 1, SUM)
    if FP32_DOT:
        acc = acc * correction[:, None] + _dot(p, v, FP32_DOT)
    else:
        acc = acc * correction[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)  # p rounded for the tensor cores
    return new_max, row_sum, acc


@triton.jit
def _find_chunk(query_start_ptr, tile_id, num_seqs, num_search_steps, BLOCK_Q: tl.constexpr):
    """The last chunk whose first tile id (query_start // BLOCK_Q + its index) is <= tile_id; the
    ids grow strictly with the index and leave each chunk room for all its tiles."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    for _ in range(num_search_steps):
        mid = (lo + hi + 1) // 2
        fits = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= tile_id
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, num_cached_ptr,
                          query_start_ptr, scale, num_seqs, num_search_steps,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                          stride_kcb, stride_kch, stride_kcd, stride_vcb, stride_vch, stride_vct, stride_tb,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, FP32_DOT: tl.constexpr):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_chunk(query_start_ptr, tile_id, num_seqs, num_search_steps, BLOCK_Q)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    q_tile = tile_id - (query_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:  # a spare tile of the upper-bound grid
        return
    num_cached = tl.load(num_cached_ptr + seq)

    # rows are (token, head of the group) pairs, the group's heads adjacent
    m = tl.arange(0, BLOCK_Q * BLOCK_G)
    row_token = q_tile * BLOCK_Q + m // BLOCK_G  # index within the chunk
    row_head = kv_head * GROUP + m % BLOCK_G
    row_ok = (row_token < query_len) & (m % BLOCK_G < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    row_offsets = (query_start + row_token).to(tl.int64)
    q = tl.load(q_ptr + row_offsets[:, None] * stride_qt + row_head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    row_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * BLOCK_G, BLOCK_D], 0.0, tl.float32)

    # the cached prefix: every row sees all of it
    table_row = tables_ptr + seq * stride_tb
    for key_start in range(0, num_cached, BLOCK_N):
        position = key_start + n
        key_ok = position < num_cached
        block = tl.load(table_row + position // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = position % BLOCK_SIZE
        k = tl.load(key_cache_ptr + block[None, :] * stride_kcb + kv_head * stride_kch + d[:, None] * stride_kcd
                    + offset[None, :], mask=d_ok[:, None] & key_ok[None, :], other=0.0).to(COMPUTE)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vcb + kv_head * stride_vch
                    + offset[:, None] * stride_vct + d[None, :], mask=key_ok[:, None] & d_ok[None, :],
                    other=0.0).to(COMPUTE)
        row_max, row_sum, acc = _softmax_step(q, k, v, key_ok[None, :], scale, row_max, row_sum, acc, FP32_DOT)

    # the chunk's own keys, causal: none past the tile's last token is needed
    num_own_keys = tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    for key_start in range(0, num_own_keys, BLOCK_N):
        key_token = key_start + n
        key_ok = key_token < query_len
        key_offsets = (query_start + key_token).to(tl.int64)
        k = tl.load(k_ptr + key_offsets[None, :] * stride_kt + kv_head * stride_kh + d[:, None],
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0).to(COMPUTE)
        v = tl.load(v_ptr + key_offsets[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
        allowed = key_ok[None, :] & (key_token[None, :] <= row_token[:, None])
        row_max, row_sum, acc = _softmax_step(q, k, v, allowed, scale, row_max, row_sum, acc, FP32_DOT)

    out = acc / row_sum[:, None]
    tl.store(out_ptr + row_offsets[:, None] * stride_ot + row_head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The same as paged_decode.py's: each kernel module holds its own jit helpers, since the interpreter
# runs only those of the module the tests imported under it (tests/conftest.py).
@triton.jit
def _softmax_step_halves(q_low, q_high, k_low, k_high, v_low, v_high, allowed, scale, row_max, row_sum, acc_low,
                         acc_high, FP32_DOT: tl.constexpr):
    """_softmax_step over a head dim split in halves: scores sum the halves' dots, each half of
    the output accumulates its own."""
    s = tl.where(allowed, (_dot(q_low, k_low, FP32_DOT) + _dot(q_high, k_high, FP32_DOT)) * scale, NEG_INF)
    new_max = tl.maximum(row_max, tl.reduce(s, 1, MAX))
    p = tl.exp(s - new_max[:, None])
    correction = tl.exp(row_max - new_max)
    row_sum = row_sum * correction + tl.reduce(p, 1, SUM)
    if not FP32_DOT:
        p = p.to(v_low.dtype)  # rounded for the tensor cores
    acc_low = acc_low * correction[:, None] + _dot(p, v_low, FP32_DOT)
    acc_high = acc_high * correction[:, None] + _dot(p, v_high, FP32_DOT)
    return new_max, row_sum, acc_low, acc_high


@triton.jit
def _cached_halves(key_codes_ptr, key_halves_ptr, value_codes_ptr, value_halves_ptr, table_row, position, key_ok,
                   kv_head, stride_key_block, stride_key_head, stride_value_block, stride_value_head, h_ok,
                   k_low_column, k_high_column, v_low_column, v_high_column, k_scale_row, v_scale_row,
                   BLOCK_SIZE: tl.constexpr, K_MINS_AFTER: tl.constexpr, K_IS_INT4: tl.constexpr,
                   V_CODE_COLS: tl.constexpr, V_MINS_AFTER: tl.constexpr, V_IS_INT4: tl.constexpr,
                   COMPUTE: tl.constexpr):
    """The cached prefix's keys [BLOCK_H, BLOCK_N] and values [BLOCK_N, BLOCK_H] at `position`, read
    from the pools' units through the table and dequantized, as (low, high) halves each."""
    block = tl.load(table_row + position // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    offset = position % BLOCK_SIZE
    # bytes; the fp16 views' offsets are half
    key_unit = block * stride_key_block + kv_head * stride_key_head
    value_unit = block * stride_value_block + kv_head * stride_value_head
    # keys' codes [code_cols, block_size]: a [BLOCK_H, BLOCK_N] tile
    k_low, k_high = _dequantized_halves(key_codes_ptr, key_halves_ptr,
                                        key_unit[None, :] + k_low_column[:, None] * BLOCK_SIZE + offset[None, :],
                                        key_unit[None, :] + k_high_column[:, None] * BLOCK_SIZE + offset[None, :],
                                        (key_unit // 2)[None, :] + k_scale_row[:, None] + offset[None, :],
                                        h_ok[:, None] & key_ok[None, :], K_MINS_AFTER, K_IS_INT4, COMPUTE)
    # values' codes [block_size, code_cols]: a [BLOCK_N, BLOCK_H] tile
    value_row = value_unit + offset * V_CODE_COLS
    v_low, v_high = _dequantized_halves(value_codes_ptr, value_halves_ptr,
                                        value_row[:, None] + v_low_column[None, :],
                                        value_row[:, None] + v_high_column[None, :],
                                        (value_unit // 2 + offset)[:, None] + v_scale_row[None, :],
                                        key_ok[:, None] & h_ok[None, :], V_MINS_AFTER, V_IS_INT4, COMPUTE)
    return k_low, k_high, v_low, v_high


@triton.jit
def _chunk_halves(k_ptr, v_ptr, key_offsets, key_ok, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, low_channel,
                  h_ok, COMPUTE: tl.constexpr):
    """The chunk's own keys [BLOCK_H, BLOCK_N] and values [BLOCK_N, BLOCK_H] at rows `key_offsets`,
    dense, as (low, high) halves each."""
    k_at = k_ptr + key_offsets[None, :] * stride_kt + kv_head * stride_kh + low_channel[:, None]
    k_mask = h_ok[:, None] & key_ok[None, :]
    k_low = tl.load(k_at, mask=k_mask, other=0.0).to(COMPUTE)
    k_high = tl.load(k_at + HALF_GROUP, mask=k_mask, other=0.0).to(COMPUTE)
    v_at = v_ptr + key_offsets[:, None] * stride_vt + kv_head * stride_vh + low_channel[None, :]
    v_mask = key_ok[:, None] & h_ok[None, :]
    v_low = tl.load(v_at, mask=v_mask, other=0.0).to(COMPUTE)
    v_high = tl.load(v_at + HALF_GROUP, mask=v_mask, other=0.0).to(COMPUTE)
    return k_low, k_high, v_low, v_high


@triton.jit
def _paged_prefill_quantized_kernel(q_ptr, k_ptr, v_ptr, out_ptr, key_codes_ptr, key_halves_ptr, value_codes_ptr,
                                    value_halves_ptr, tables_ptr, num_cached_ptr, query_start_ptr, scale, num_seqs,
                                    num_search_steps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                    stride_vh, stride_ot, stride_oh, stride_key_block, stride_key_head,
                                    stride_value_block, stride_value_head, stride_tb,
                                    GROUP: tl.constexpr, HALF_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                    K_SCALES_AT: tl.constexpr, K_MINS_AFTER: tl.constexpr, K_IS_INT4: tl.constexpr,
                                    V_CODE_COLS: tl.constexpr, V_SCALES_AT: tl.constexpr, V_MINS_AFTER: tl.constexpr,
                                    V_IS_INT4: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
                                    FP32_DOT: tl.constexpr):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_chunk(query_start_ptr, tile_id, num_seqs, num_search_steps, BLOCK_Q)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    q_tile = tile_id - (query_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:  # a spare tile of the upper-bound grid
        return
    num_cached = tl.load(num_cached_ptr + seq)

    # rows are (token, head of the group) pairs, the group's heads adjacent
    m = tl.arange(0, BLOCK_Q * BLOCK_G)
    row_token = q_tile * BLOCK_Q + m // BLOCK_G  # index within the chunk
    row_head = kv_head * GROUP + m % BLOCK_G
    row_ok = (row_token < query_len) & (m % BLOCK_G < GROUP)
    h = tl.arange(0, BLOCK_H)  # a channel of the low half of its group; h + HALF_GROUP's is the high one
    h_ok = h < HALF_DIM
    low_channel = (h // HALF_GROUP) * CHANNELS_PER_GROUP + h % HALF_GROUP
    n = tl.arange(0, BLOCK_N)
    row_offsets = (query_start + row_token).to(tl.int64)
    q_at = q_ptr + row_offsets[:, None] * stride_qt + row_head[:, None] * stride_qh + low_channel[None, :]
    q_mask = row_ok[:, None] & h_ok[None, :]
    q_low = tl.load(q_at, mask=q_mask, other=0.0).to(COMPUTE)
    q_high = tl.load(q_at + HALF_GROUP, mask=q_mask, other=0.0).to(COMPUTE)
    k_low_column, k_high_column = _code_columns(h, low_channel, K_IS_INT4)
    v_low_column, v_high_column = _code_columns(h, low_channel, V_IS_INT4)
    group_row = (h // HALF_GROUP) * BLOCK_SIZE  # fp16 offset of each channel's group scales in the scales
    k_scale_row = K_SCALES_AT + group_row
    v_scale_row = V_SCALES_AT + group_row
    row_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.full([BLOCK_Q * BLOCK_G], 0.0, tl.float32)
    acc_low = tl.full([BLOCK_Q * BLOCK_G, BLOCK_H], 0.0, tl.float32)
    acc_high = tl.full([BLOCK_Q * BLOCK_G, BLOCK_H], 0.0, tl.float32)

    # the cached prefix, from the pools: every row sees all of it
    table_row = tables_ptr + seq * stride_tb
    for key_start in range(0, num_cached, BLOCK_N):
        position = key_start + n
        key_ok = position < num_cached
        k_low, k_high, v_low, v_high = _cached_halves(
            key_codes_ptr, key_halves_ptr, value_codes_ptr, value_halves_ptr, table_row, position, key_ok, kv_head,
            stride_key_block, stride_key_head, stride_value_block, stride_value_head, h_ok, k_low_column,
            k_high_column, v_low_column, v_high_column, k_scale_row, v_scale_row, BLOCK_SIZE, K_MINS_AFTER,
            K_IS_INT4, V_CODE_COLS, V_MINS_AFTER, V_IS_INT4, COMPUTE)
        row_max, row_sum, acc_low, acc_high = _softmax_step_halves(
            q_low, q_high, k_low, k_high, v_low, v_high, key_ok[None, :], scale, row_max, row_sum, acc_low, acc_high,
            FP32_DOT)

    # the chunk's own keys, dense and causal: none past the tile's last token is needed
    num_own_keys = tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    for key_start in range(0, num_own_keys, BLOCK_N):
        key_token = key_start + n
        key_ok = key_token < query_len
        key_offsets = (query_start + key_token).to(tl.int64)
        k_low, k_high, v_low, v_high = _chunk_halves(k_ptr, v_ptr, key_offsets, key_ok, kv_head, stride_kt, stride_kh,
                                                     stride_vt, stride_vh, low_channel, h_ok, COMPUTE)
        allowed = key_ok[None, :] & (key_token[None, :] <= row_token[:, None])
        row_max, row_sum, acc_low, acc_high = _softmax_step_halves(
            q_low, q_high, k_low, k_high, v_low, v_high, allowed, scale, row_max, row_sum, acc_low, acc_high, FP32_DOT)

    out_at = out_ptr + row_offsets[:, None] * stride_ot + row_head[:, None] * stride_oh + low_channel[None, :]
    tl.store(out_at, (acc_low / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(out_at + HALF_GROUP, (acc_high / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


def _tile(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dimension is contiguous (a view of a fused QKV stays a view)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def paged_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor, num_cached: torch.Tensor,
                            query_start: torch.Tensor, scale: float, kv_format: str | None = None,
                            block_size: int | None = None) -> torch.Tensor:
    """Causal attention of packed prefill chunks over their cached prefixes and their own tokens.

    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim] (the chunks' own
    K/V); caches as above; block_tables [num_seqs, max_blocks] int32 (each chunk's sequence);
    num_cached [num_seqs] int32 (prefix length already in the cache); query_start [num_seqs + 1]
    int32 (chunk i is rows query_start[i]:query_start[i + 1], query_start[-1] == num_tokens)
    -> out [num_tokens, num_heads, head_dim] in q's dtype. Row j of chunk i attends to positions
    0..num_cached[i] + j. The tables must hold the prefix's blocks; values are not checked (that
    would need a host sync). With `kv_format` (int8, int4, k8v4) the caches are group-quantized pools
    [num_blocks, kv_heads, unit_bytes] uint8 of kernels/kv_quant.py's layout, `block_size` tokens a
    block (not in their shape). Raises ValueError on malformed shapes or dtypes."""
    if kv_format is not None:
        return _quantized_prefill(q, k, v, key_cache, value_cache, block_tables, num_cached, query_start, scale,
                                  kv_format, block_size)
    _check(q, k, v, key_cache, value_cache, block_tables, num_cached, query_start)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = value_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    block_tables, num_cached, query_start = block_tables.contiguous(), num_cached.contiguous(), query_start.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cache_dtype = value_cache.dtype
    block_g = triton.next_power_of_2(group)
    block_q = max(1, ROWS_PER_TILE // block_g)
    num_q_tiles = num_tokens // block_q + num_seqs  # >= the chunks' tiles, however ragged
    _paged_prefill_kernel[(num_q_tiles, num_kv_heads)](
        q, k, v, out, key_cache, value_cache, block_tables, num_cached, query_start, float(scale),
        num_seqs, num_seqs.bit_length(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_Q=block_q,
        BLOCK_D=_tile(head_dim), BLOCK_N=KEYS_PER_TILE,
        COMPUTE=tl.float32 if INTERPRETED else _TL_DTYPES[cache_dtype],
        FP32_DOT=INTERPRETED or cache_dtype == torch.float32)
    return out


def _quantized_prefill(q, k, v, key_pool, value_pool, block_tables, num_cached, query_start, scale: float,
                       kv_format: str, block_size: int | None) -> torch.Tensor:
    """paged_prefill_attention over group-quantized pools."""
    _check_dims(q, k, v)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"a {kv_format} KV cache needs its block_size, got {block_size!r}")
    num_tokens, num_heads, head_dim = q.shape
    layout = layout_for(kv_format, head_dim, block_size)
    num_kv_heads = check_pools(key_pool, value_pool, layout)
    _check_chunks(q, k, v, num_kv_heads, head_dim)
    _check_tables(block_tables, num_cached, query_start, (q, k, v, key_pool, value_pool))
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    # the prefix's keys are stored rotated (kv_quant): the queries and the chunk's own keys meet them so
    q, k = rotate(q.float()).to(q.dtype), rotate(k.float()).to(k.dtype)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    block_tables, num_cached, query_start = block_tables.contiguous(), num_cached.contiguous(), query_start.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_q = max(1, ROWS_PER_TILE // block_g)
    num_q_tiles = num_tokens // block_q + num_seqs  # >= the chunks' tiles, however ragged
    _paged_prefill_quantized_kernel[(num_q_tiles, num_kv_heads)](
        q, k, v, out, key_pool.view(layout.key.code_dtype), key_pool.view(torch.float16),
        value_pool.view(layout.value.code_dtype), value_pool.view(torch.float16), block_tables, num_cached,
        query_start, float(scale), num_seqs, num_seqs.bit_length(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1), block_tables.stride(0),
        GROUP=group, HALF_DIM=head_dim // 2, BLOCK_SIZE=block_size, **side_constants(layout),
        BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_H=_tile(head_dim // 2), BLOCK_N=KEYS_PER_TILE,
        COMPUTE=tl.float32 if INTERPRETED else _TL_DTYPES[q.dtype], FP32_DOT=INTERPRETED or q.dtype == torch.float32)
    return out


def _check(q, k, v, key_cache, value_cache, block_tables, num_cached, query_start) -> None:
    _check_dims(q, k, v)
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(f"the caches must be 4-D, got {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_blocks, num_kv_heads, block_size, head_dim = value_cache.shape
    if tuple(key_cache.shape) != (num_blocks, num_kv_heads, head_dim, block_size):
        raise ValueError(f"key_cache must be [num_blocks, num_kv_heads, head_dim, block_size] = "
                         f"{(num_blocks, num_kv_heads, head_dim, block_size)}, got {tuple(key_cache.shape)}")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches' last dimension must be contiguous")
    _check_chunks(q, k, v, num_kv_heads, head_dim)
    if value_cache.dtype not in _TL_DTYPES or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"the caches must share one dtype of fp32, bf16 or fp16, got {key_cache.dtype}, "
                         f"{value_cache.dtype}")
    _check_tables(block_tables, num_cached, query_start, (q, k, v, key_cache, value_cache))


def _check_dims(q, k, v) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k and v must be [num_tokens, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")


def _check_chunks(q, k, v, num_kv_heads: int, head_dim: int) -> None:
    num_tokens = q.shape[0]
    if tuple(k.shape) != (num_tokens, num_kv_heads, head_dim) or tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must be [num_tokens, num_kv_heads, head_dim] = "
                         f"{(num_tokens, num_kv_heads, head_dim)}, got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit {num_kv_heads} KV heads of {head_dim}")
    if q.dtype not in _TL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of fp32, bf16 or fp16, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_tables(block_tables, num_cached, query_start, tensors: tuple) -> None:
    if block_tables.dtype != torch.int32 or num_cached.dtype != torch.int32 or query_start.dtype != torch.int32:
        raise ValueError(f"block_tables, num_cached and query_start must be int32, got {block_tables.dtype}, "
                         f"{num_cached.dtype}, {query_start.dtype}")
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    if num_seqs < 0 or tuple(num_cached.shape) != (num_seqs,) or tuple(query_start.shape) != (num_seqs + 1,):
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], num_cached [num_seqs] and query_start "
                         f"[num_seqs + 1], got {tuple(block_tables.shape)}, {tuple(num_cached.shape)}, "
                         f"{tuple(query_start.shape)}")
    devices = {t.device for t in (*tensors, block_tables, num_cached, query_start)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
