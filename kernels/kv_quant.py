"""Group-quantized KV cache blocks: the layout every kernel reads and the plain torch reference.

A quantized pool holds, per layer, `[num_blocks, num_kv_heads, unit_bytes]` uint8: each (block,
kv head) *unit* is one byte run, so swaps, prefix-cache and host-tier copies move it as it is.
A unit holds the codes of `block_size` tokens, then fp16 scales, then (INT4) fp16 minimums,
one per group of `GROUP_SIZE` channels of each token:

- keys, codes transposed like the 16-bit pools: `[code_rows, block_size]`, row r over tokens;
- values, codes by token: `[block_size, code_rows]`;
- scales (and mins) `[num_groups, block_size]` for both, so a vector load takes several tokens'.

Keys are stored rotated: each group of a key row times H, the orthonormal Sylvester-Hadamard
matrix of GROUP_SIZE (symmetric, its own inverse). A few key channels carry most of the magnitude,
and an absmax scale would crush the rest; the rotation spreads them over the group (on the embedded
SmolLM2, INT8 top-1 agreement 98.1% -> 99.6%, INT4 perplexity +10.7% -> +0.4%). Scores need no
inverse: q . k = (q H) . (k H), so a kernel rotates the query once and reads the codes as stored.

A format names the codes of each pool: `int8` and `int4` both pools alike, `k8v4` INT8 keys and
INT4 values, since 4-bit keys cost the most (on the embedded SmolLM2 against a 16-bit cache, INT4
keys over INT8 values: top-1 agreement 87.5%, perplexity +4.1%; INT8 keys over INT4 values: 92.2%,
+0.6%). The key and value pools then hold units of different sizes, each one byte run as before.

INT8 is symmetric (x = scale * code, code in [-127, 127]); INT4 asymmetric (x = min + scale *
code, code in [0, 15]), two codes a byte: within a group, byte j holds channel j in its low
nibble and channel j + GROUP_SIZE / 2 in its high one, so one byte load widens into two natural-
order vectors. Codes are round-half-even(x / scale) in fp32, with the fp16-rounded scale and min.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 64
SCALE_BYTES = 2  # fp16
# tandem::DType codes of the quantized KV formats (kernels/cpu/dtypes.h)
FORMAT_CODES = {"int8": 3, "int4": 4, "k8v4": 5}
# (key bits, value bits) of each format
FORMAT_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4)}


@dataclass(frozen=True)
class QuantLayout:
    """Where a unit's parts lie, for one format, head_dim and block_size."""

    bits: int  # 8 or 4
    head_dim: int
    block_size: int

    @property
    def has_min(self) -> bool:
        return self.bits == 4

    @property
    def num_groups(self) -> int:
        return self.head_dim // GROUP_SIZE

    @property
    def code_cols(self) -> int:
        """Bytes of one token's codes."""
        return self.head_dim * self.bits // 8

    @property
    def code_bytes(self) -> int:
        return self.code_cols * self.block_size

    @property
    def scale_bytes(self) -> int:
        return self.num_groups * self.block_size * SCALE_BYTES

    @property
    def unit_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes * (2 if self.has_min else 1)

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8


@dataclass(frozen=True)
class FormatLayout:
    """A format's key and value units (one shape for both in int8 and int4, two in k8v4)."""

    key: QuantLayout
    value: QuantLayout

    def side(self, is_key: bool) -> QuantLayout:
        return self.key if is_key else self.value

    @property
    def block_size(self) -> int:
        return self.key.block_size


def layout_for(name: str, head_dim: int, block_size: int) -> FormatLayout:
    """The layouts of format `name` (int8, int4, k8v4); ValueError where it cannot hold head_dim."""
    if name not in FORMAT_BITS:
        raise ValueError(f"unknown quantized KV format {name!r}; choose from {sorted(FORMAT_BITS)}")
    if head_dim % GROUP_SIZE:
        raise ValueError(f"a {name} KV cache needs head_dim a multiple of {GROUP_SIZE}, got {head_dim}")
    key_bits, value_bits = FORMAT_BITS[name]
    return FormatLayout(QuantLayout(key_bits, head_dim, block_size), QuantLayout(value_bits, head_dim, block_size))


# ---- the keys' rotation ----------------------------------------------------------------------
def rotate(x: torch.Tensor) -> torch.Tensor:
    """Each group of x [..., head_dim] times H (its own inverse), in x's dtype: a fast
    Walsh-Hadamard transform whose butterflies run in the C++ kernels' order (kv_quant.h), so
    both give the same bits."""
    groups = x.unflatten(-1, (-1, GROUP_SIZE))
    span = 1
    while span < GROUP_SIZE:
        pairs = groups.unflatten(-1, (-1, 2, span))  # [..., GROUP_SIZE / (2 span), 2, span]
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        groups = torch.stack([low + high, low - high], dim=-2).flatten(-3)
        span *= 2
    return (groups * GROUP_SIZE ** -0.5).flatten(-2)


# ---- quantization of token rows -------------------------------------------------------------
def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> codes [..., head_dim] (natural order: int8, or uint8 in [0, 15]),
    scales [..., num_groups] fp16, mins [..., num_groups] fp16 (INT4) or None."""
    groups = x.float().unflatten(-1, (-1, GROUP_SIZE))  # [..., num_groups, GROUP_SIZE]
    if bits == 8:
        scales = (groups.abs().amax(-1) / 127).half()
        codes = _divide(groups, scales.float()).round().clamp(-127, 127).to(torch.int8)
        return codes.flatten(-2), scales, None
    low, high = groups.amin(-1) + 0.0, groups.amax(-1)  # + 0.0: which zero amin keeps is not defined
    scales, mins = ((high - low) / 15).half(), low.half()
    codes = _divide(groups - mins.float()[..., None], scales.float()).round().clamp(0, 15).to(torch.uint8)
    return codes.flatten(-2), scales, mins


def _divide(groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """groups / scale per group; a group of zero range gets codes 0."""
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
    return torch.where(scales[..., None] > 0, groups / safe, torch.zeros_like(groups))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The inverse of `quantize`, in fp32: [..., head_dim]."""
    groups = codes.float().unflatten(-1, (-1, GROUP_SIZE))
    out = groups * scales.float()[..., None]
    if mins is not None:
        out = out + mins.float()[..., None]
    return out.flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """INT4 codes [..., head_dim] uint8 -> [..., head_dim / 2]: per group, byte j holds channel j
    (low nibble) and channel j + GROUP_SIZE / 2 (high)."""
    groups = codes.unflatten(-1, (-1, 2, GROUP_SIZE // 2))
    return (groups[..., 0, :] | (groups[..., 1, :] << 4)).flatten(-2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`."""
    groups = packed.unflatten(-1, (-1, GROUP_SIZE // 2))
    return torch.stack([groups & 0xF, groups >> 4], dim=-2).flatten(-3)


def query_round_trip(query: torch.Tensor) -> torch.Tensor:
    """The query [..., head_dim] (fp32, pre-scaled) as a kernel that scores keys by integer dot
    products reads it: each rotated group as int8 codes round-half-even(q * (1 / step)) with an
    fp32 step max|q| / 127 (codes 0 for a zero group), rotated back, in fp32."""
    groups = rotate(query.float()).unflatten(-1, (-1, GROUP_SIZE))
    steps = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(steps > 0, 1 / torch.where(steps > 0, steps, torch.ones_like(steps)), torch.zeros_like(steps))
    return rotate(((groups * inverse).round() * steps).flatten(-2))


def round_trip(rows: torch.Tensor, bits: int, is_key: bool) -> torch.Tensor:
    """Rows [..., head_dim] as a write and a read would give them back (fp32)."""
    if not is_key:
        return dequantize(*quantize(rows, bits))
    return rotate(dequantize(*quantize(rotate(rows.float()), bits)))


def check_pools(key_pool: torch.Tensor, value_pool: torch.Tensor, layout: FormatLayout) -> int:
    """The number of KV heads of one layer's key and value pools, after checking they are units of
    `layout`'s key and value sides, contiguous and 2-byte aligned (their fp16 parts are read through
    fp16 views), with one number of blocks and heads; ValueError where not."""
    for name, pool, side in (("key", key_pool, layout.key), ("value", value_pool, layout.value)):
        if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[2] != side.unit_bytes:
            raise ValueError(f"a quantized {name} pool must be uint8 [num_blocks, kv_heads, {side.unit_bytes}], "
                             f"got {pool.dtype} {tuple(pool.shape)}")
        if pool.stride(2) != 1 or pool.stride(1) % 2 or pool.stride(0) % 2:
            raise ValueError(f"the {name} pool's units must be contiguous and 2-byte aligned")
    if key_pool.shape[:2] != value_pool.shape[:2]:
        raise ValueError("the key and value pools must hold one number of blocks and KV heads")
    return key_pool.shape[1]


# ---- a pool layer's units as views ------------------------------------------------------------
@dataclass(frozen=True)
class UnitViews:
    """One layer's units of keys or values, as views into the pool's bytes (writes go to it).
    codes: keys [blocks, kv_heads, code_cols, block_size], values [blocks, kv_heads, block_size,
    code_cols] (int8, or uint8 packed nibbles); scales, mins: [blocks, kv_heads, num_groups, block_size]."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    is_key: bool


def unit_views(pool: torch.Tensor, layout: QuantLayout, is_key: bool) -> UnitViews:
    """Views of a layer's pool `pool` [blocks, kv_heads, unit_bytes] uint8."""
    blocks, heads, _ = pool.shape
    code_shape = (layout.code_cols, layout.block_size) if is_key else (layout.block_size, layout.code_cols)
    codes = pool[..., :layout.code_bytes].view(layout.code_dtype).view(blocks, heads, *code_shape)

    def fp16_part(start: int) -> torch.Tensor:
        part = pool[..., start:start + layout.scale_bytes]
        return part.view(torch.float16).view(blocks, heads, layout.num_groups, layout.block_size)

    scales = fp16_part(layout.code_bytes)
    mins = fp16_part(layout.code_bytes + layout.scale_bytes) if layout.has_min else None
    return UnitViews(codes, scales, mins, is_key)


def write_rows(views: UnitViews, layout: QuantLayout, rows: torch.Tensor, slot_blocks: torch.Tensor,
               slot_offsets: torch.Tensor) -> None:
    """Quantize `rows` [num_tokens, kv_heads, head_dim] into the (block, offset) slots (keys rotated)."""
    codes, scales, mins = quantize(rotate(rows.float()) if views.is_key else rows, layout.bits)
    if layout.bits == 4:
        codes = pack_nibbles(codes)
    codes = codes.to(views.codes.device)
    if views.is_key:  # advanced indices around a slice put the token dim first
        views.codes.transpose(-1, -2)[slot_blocks, :, slot_offsets] = codes
    else:
        views.codes[slot_blocks, :, slot_offsets] = codes
    views.scales.transpose(-1, -2)[slot_blocks, :, slot_offsets] = scales.to(views.scales.device)
    if mins is not None:
        views.mins.transpose(-1, -2)[slot_blocks, :, slot_offsets] = mins.to(views.mins.device)


def read_blocks(views: UnitViews, layout: QuantLayout, block_ids: torch.Tensor) -> torch.Tensor:
    """The dequantized rows of blocks `block_ids` [n] int64: [n, kv_heads, block_size, head_dim] fp32
    (keys rotated back)."""
    codes = views.codes[block_ids]
    if views.is_key:
        codes = codes.transpose(-1, -2)
    if layout.bits == 4:
        codes = unpack_nibbles(codes)
    scales = views.scales[block_ids].transpose(-1, -2)  # [n, kv_heads, block_size, num_groups]
    mins = views.mins[block_ids].transpose(-1, -2) if views.mins is not None else None
    rows = dequantize(codes, scales, mins)
    return rotate(rows) if views.is_key else rows


def dequantize_pool(pool: torch.Tensor, layout: QuantLayout, is_key: bool) -> torch.Tensor:
    """A whole layer's pool as the 16-bit kernels' fp32 layout (keys [blocks, kv_heads, head_dim,
    block_size], values [blocks, kv_heads, block_size, head_dim]): what the reference attends."""
    views = unit_views(pool, layout, is_key)
    rows = read_blocks(views, layout, torch.arange(pool.shape[0], device=pool.device))
    return rows.transpose(-1, -2).contiguous() if is_key else rows
