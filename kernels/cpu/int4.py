"""Group-wise INT4 weights: packing, round-to-nearest quantization, and the matmul.

Layout (kernels/cpu/int4.h): `qweight` uint8 [n, k / 2], each run of 32 weights along k stored
as 16 bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31 (GGUF Q4's own
order); `scales` and `mins` fp32 [n, k / group_size], weight = scale * q + min, q in 0..15.
"""
from __future__ import annotations

import torch

from kernels.cpu import _DTYPE_CODES, _check_shape, _check_tensor, _extension

BLOCK = 32  # weights per 16-byte block
GROUP_SIZES = (32, 64, 128)
MAX_LEVEL = 15  # q in [0, MAX_LEVEL]


def check_group_size(group_size: int, k: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"the input dimension ({k}) must be a multiple of group_size ({group_size})")


def pack(levels: torch.Tensor) -> torch.Tensor:
    """levels uint8 [n, k] in 0..15 -> qweight uint8 [n, k / 2] in block order."""
    n, k = levels.shape
    blocks = levels.reshape(n, k // BLOCK, 2, BLOCK // 2)  # [n, blocks, low/high half, 16]
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [n, k / 2] -> levels uint8 [n, k]."""
    n, half = qweight.shape
    blocks = qweight.reshape(n, half * 2 // BLOCK, BLOCK // 2)
    return torch.stack([blocks & 0xF, blocks >> 4], dim=2).reshape(n, half * 2)


def quantize_rtn(weight: torch.Tensor, group_size: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest with each group's own min and scale: weight [n, k] ->
    (qweight [n, k / 2], scales [n, k / group_size], mins [n, k / group_size]). A group's
    smallest weight is exact, its largest within rounding; a constant group gets scale 0."""
    n, k = weight.shape
    check_group_size(group_size, k)
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (high - low) / MAX_LEVEL
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    levels = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, MAX_LEVEL).to(torch.uint8)
    return pack(levels.reshape(n, k)), scales.contiguous(), low.contiguous()


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [n, k] the packed form stands for."""
    levels = unpack(qweight).float()
    n, k = levels.shape
    groups = levels.reshape(n, k // group_size, group_size)
    return (groups * scales[..., None] + mins[..., None]).reshape(n, k)


def dequantize_into(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    out: torch.Tensor, num_threads: int = 1, isa: str | None = None) -> torch.Tensor:
    """The C++ `dequantize`: W's rows [n, k] written into `out` (fp32, bf16 or fp16, contiguous),
    at memory speed; what the large-batch path multiplies. Returns `out`."""
    _check_tensor("qweight", qweight, 2, (torch.uint8,))
    n, k = qweight.shape[0], qweight.shape[1] * 2
    check_group_size(group_size, k)
    _check_tensor("out", out, 2, _DTYPE_CODES)
    _check_shape("out", out, (n, k))
    for name, tensor in (("scales", scales), ("mins", mins)):
        _check_tensor(name, tensor, 2, (torch.float32,))
        _check_shape(name, tensor, (n, k // group_size))
    _extension().int4_dequantize(qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), out.data_ptr(),
                                 _DTYPE_CODES[out.dtype], n, k, group_size, int(num_threads), isa or "")
    return out


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int, num_threads: int = 1, isa: str | None = None) -> torch.Tensor:
    """y = x @ W^T for packed W: x [batch, k] fp32/bf16/fp16 -> y [batch, n] in x's dtype, fp32
    arithmetic. The GIL is released while the kernel runs. Raises ValueError on malformed input."""
    _check_tensor("x", x, 2, (torch.float32, torch.bfloat16, torch.float16))
    _check_tensor("qweight", qweight, 2, (torch.uint8,))
    batch, k = x.shape
    n = qweight.shape[0]
    check_group_size(group_size, k)
    _check_shape("qweight", qweight, (n, k // 2))
    for name, tensor in (("scales", scales), ("mins", mins)):
        _check_tensor(name, tensor, 2, (torch.float32,))
        _check_shape(name, tensor, (n, k // group_size))
    x32 = x.float().contiguous()
    y = torch.empty(batch, n, dtype=torch.float32)
    _extension().int4_linear(x32.data_ptr(), qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), y.data_ptr(),
                             batch, n, k, group_size, int(num_threads), isa or "")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
