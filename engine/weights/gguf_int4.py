"""GGUF 4-bit blocks repacked exactly into int4.h's layout (engine.quant.int4.PackedInt4).

One small repacker per GGUF type, in `REPACKERS`. Each takes a tensor's raw blocks, uint8
[rows, blocks_per_row, bytes_per_block], and gives the same weights as codes in int4.h's order
(per 32 weights, 16 bytes: byte i = weight i | weight i + 16 << 4) with fp32 scales and mins
per group of 32. Every repacker is exact: its PackedInt4 dequantizes to gguf.quants.dequantize's
fp32 values bit for bit (tests/engine/weights checks each on random blocks).
"""
from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType

from engine.quant.int4 import PackedInt4

GROUP_SIZE = 32  # int4.h's block; every type below has one scale and min per 32 weights
_Q4_0_OFFSET = 8  # Q4_0 stores q + 8: weight = d * (q - 8)
_NIBBLE = 0xF
_SIX_BITS = 0x3F


def _fp16(field: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] holding one fp16 each -> fp32 [...], exactly."""
    return field.contiguous().view(torch.float16).squeeze(-1).float()


def _packed(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> PackedInt4:
    """codes uint8 [rows, ..., 16] in int4.h's order; scales, mins [rows, ...], one per 32."""
    rows = codes.shape[0]
    return PackedInt4(codes.reshape(rows, -1).contiguous(), scales.reshape(rows, -1).contiguous(),
                      mins.reshape(rows, -1).contiguous(), GROUP_SIZE)


def repack_q4_0(blocks: torch.Tensor) -> PackedInt4:
    """Q4_0, 18 bytes per 32 weights: fp16 d, then 16 bytes of codes already in int4.h's order;
    weight = d * (q - 8), so scale = d and min = -8 * d (a power of two times d: exact)."""
    scales = _fp16(blocks[..., 0:2])
    return _packed(blocks[..., 2:], scales, -_Q4_0_OFFSET * scales)


def repack_q4_1(blocks: torch.Tensor) -> PackedInt4:
    """Q4_1, 20 bytes per 32 weights: fp16 d, fp16 m, then 16 bytes of codes already in
    int4.h's order; weight = d * q + m, so scale = d and min = m, fp16 widened."""
    return _packed(blocks[..., 4:], _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]))


def repack_q4_k(blocks: torch.Tensor) -> PackedInt4:
    """Q4_K, 144 bytes per super-block of 256 weights (8 sub-blocks of 32): fp16 d, fp16 dmin,
    12 bytes of 6-bit sub-block scales and mins, 128 bytes of codes; weight in sub-block j =
    d * sc_j * q - dmin * m_j.

    scale = d * sc_j and min = -(dmin * m_j), in fp32, are exact: an fp16 has an 11-bit
    significand and sc_j, m_j are 6-bit integers, so each product fits fp32's 24 bits. Then
    scale * q (17 bits times 4) is exact too, and int4's scale * q + min rounds once where
    gguf's (d * sc) * q - dmin * m rounds once: the same fp32 values.
    """
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])  # [rows, super_blocks]
    sc, m = _q4_k_scales_and_mins(blocks[..., 4:16])  # [rows, super_blocks, 8]
    scales = d[..., None] * sc
    mins = -(dmin[..., None] * m)
    return _packed(_q4_k_codes(blocks[..., 16:]), scales, mins)


def _q4_k_scales_and_mins(field: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12-byte field [..., 12] -> the 8 sub-blocks' 6-bit scales and mins, fp32 [..., 8].

    Bytes 0-3 and 4-7 hold sub-blocks 0-3's scales and mins in their low 6 bits. Sub-blocks
    4-7 take their low 4 bits from bytes 8-11 (scale in the low nibble, min in the high one)
    and their top 2 bits from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    low_scales, low_mins, nibbles = field[..., 0:4], field[..., 4:8], field[..., 8:12]
    scales = torch.cat([low_scales & _SIX_BITS, (nibbles & _NIBBLE) | ((low_scales >> 6) << 4)], dim=-1)
    mins = torch.cat([low_mins & _SIX_BITS, (nibbles >> 4) | ((low_mins >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _q4_k_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 code bytes [..., 128] -> int4.h's order, 8 runs of 16 bytes [..., 8, 16].

    Q4_K stores the codes as 4 chunks of 32 bytes; chunk c holds sub-block 2c in its bytes' low
    nibbles and sub-block 2c + 1 in their high nibbles, weight i of each in byte i. int4.h wants
    weight i and i + 16 of one sub-block in byte i: so each sub-block's first 16 codes come from
    bytes 0-15 of its chunk and its last 16 from bytes 16-31.
    """
    chunks = qs.reshape(*qs.shape[:-1], 4, 2, 16)  # [..., chunk, bytes 0-15 / 16-31, 16]
    first, last = chunks[..., 0, :], chunks[..., 1, :]
    even = (first & _NIBBLE) | ((last & _NIBBLE) << 4)  # sub-block 2c: the low nibbles
    odd = (first >> 4) | (last & (_NIBBLE << 4))  # sub-block 2c + 1: the high nibbles
    return torch.stack([even, odd], dim=-2).reshape(*qs.shape[:-1], 8, 16)


# The GGUF types int4.h's layout holds exactly, each with its repacker.
REPACKERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], PackedInt4]] = {
    GGMLQuantizationType.Q4_0: repack_q4_0,
    GGMLQuantizationType.Q4_1: repack_q4_1,
    GGMLQuantizationType.Q4_K: repack_q4_k,
}
