"""Group-wise INT4 weights: packing, round-to-nearest quantization, and the matmul.

Layout (kernels/cpu/int4.h): `qweight` uint8 [n, k / 2], each run of 32 weights along k stored
as 16 bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31 (GGUF Q4's own
order); `scales` and `mins` fp32 [n, k / group_size], weight = scale * q + min, q in 0..15. The
matmul reads a tiled copy (`TiledInt4`: the same bytes, 16 output rows interleaved) and quantizes
x per block of 32, to int8 by default (llama.cpp's Q8_0) or int16, so that integer dot products
cover 4 weights of many rows at once; `reference_linear` is the same arithmetic in plain torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu import _DTYPE_CODES, _check_shape, _check_tensor, _extension, calibrate_num_threads, is_available

BLOCK = 32  # weights per 16-byte block
GROUP_SIZES = (32, 64, 128)
MAX_LEVEL = 15  # q in [0, MAX_LEVEL]
TILE_ROWS = 16  # output rows interleaved in one tile of the CPU layout
CHUNKS = 4  # 64-byte chunks per tile and block
ACTIVATION_BITS = (8, 16)
# Largest int of x quantized to each width, per block of 32 with its own scale max |x| / this.
MAX_QUANT = {8: 127, 16: 32767}
CODE_CENTER = 8  # codes act as q - 8 (int4.h)
# The kernel's relative error against the fp32 product on the dequantized weight, from its
# activations (per-block absmax scaling: each x off by at most half a step of max|x| / MAX_QUANT).
ACTIVATION_RELATIVE_ERROR = {8: 2e-2, 16: 1e-3}
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def check_packed(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> None:
    """ValueError unless the three tensors are one weight in the canonical layout."""
    _check_tensor("qweight", qweight, 2, (torch.uint8,))
    n, k = qweight.shape[0], qweight.shape[1] * 2
    check_group_size(group_size, k)
    for name, tensor in (("scales", scales), ("mins", mins)):
        _check_tensor(name, tensor, 2, (torch.float32,))
        _check_shape(name, tensor, (n, k // group_size))


@dataclass(frozen=True)
class TiledInt4:
    """A packed weight in the CPU kernel's tiled layout (int4.h): `codes` uint8
    [tiles, k / 32, 4, 16, 4], `scales` and `mins` fp32 [tiles, k / group_size, 16], rows past
    `n` zero. The same bytes as the canonical layout, permuted so that one 64-byte load is 4
    consecutive weights of 16 output rows."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    n: int
    group_size: int

    @property
    def k(self) -> int:
        return self.codes.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))

    @staticmethod
    def from_packed(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> "TiledInt4":
        check_packed(qweight, scales, mins, group_size)
        n, k = qweight.shape[0], qweight.shape[1] * 2
        tiles = -(-n // TILE_ROWS)
        pad = tiles * TILE_ROWS - n
        rows = F.pad(qweight, (0, 0, 0, pad)).view(tiles, TILE_ROWS, k // BLOCK, CHUNKS, 4)
        codes = rows.permute(0, 2, 3, 1, 4).contiguous()  # [tile, block, chunk, row, byte]
        return TiledInt4(codes, _tile_params(scales, pad), _tile_params(mins, pad), n, group_size)

    def to_packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qweight, scales, mins) in the canonical layout: the inverse of from_packed."""
        tiles, num_blocks = self.codes.shape[:2]
        qweight = self.codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, num_blocks * BLOCK // 2)
        params = [t.permute(0, 2, 1).reshape(tiles * TILE_ROWS, -1) for t in (self.scales, self.mins)]
        return qweight[:self.n].contiguous(), params[0][:self.n].contiguous(), params[1][:self.n].contiguous()


def _tile_params(params: torch.Tensor, pad: int) -> torch.Tensor:
    """[n, groups] -> [tiles, groups, 16]: a tile's 16 rows side by side, padded rows zero."""
    padded = F.pad(params.float(), (0, 0, 0, pad))
    return padded.view(-1, TILE_ROWS, padded.shape[1]).permute(0, 2, 1).contiguous()


def dequantize_into(weight: TiledInt4, out: torch.Tensor, num_threads: int = 1,
                    isa: str | None = None) -> torch.Tensor:
    """The C++ `dequantize`: W [n, k] written into `out` (fp32, bf16 or fp16, contiguous); what
    the large-batch path multiplies. Returns `out`."""
    _check_tensor("out", out, 2, _DTYPE_CODES)
    _check_shape("out", out, (weight.n, weight.k))
    _extension().int4_dequantize(weight.codes.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr(),
                                 out.data_ptr(), _DTYPE_CODES[out.dtype], weight.n, weight.k, weight.group_size,
                                 int(num_threads), isa or "")
    return out


def int4_linear(x: torch.Tensor, weight: TiledInt4, num_threads: int = 1, isa: str | None = None,
                activation_bits: int = 8) -> torch.Tensor:
    """y = x @ W^T: x [batch, k] fp32/bf16/fp16 -> y [batch, n] in x's dtype (read and written in
    C++: no conversion ops around the call), for any batch (prefill's included: the weight is never
    widened). x is quantized per block of 32 inside (int4.h), to int8 (the default: prefill's, 4
    products per instruction) or to int16 (`activation_bits=16`: about 1e-4 relative, decode's);
    `reference_linear` is the same arithmetic. The GIL
    is released while the kernel runs. Raises ValueError on malformed input. This is the hot path
    (one call per matmul): the checks are the few a call can get wrong, the weight's own were made
    when it was tiled."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _ACTIVATION_DTYPES or not x.is_cpu or x.dim() != 2:
        _check_tensor("x", x, 2, _ACTIVATION_DTYPES)  # names what is wrong
    batch, k = x.shape
    if k != weight.k:
        raise ValueError(f"x has {k} columns but the weight's input dimension is {weight.k}")
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, got {activation_bits}")
    x = x.contiguous()
    y = torch.empty(batch, weight.n, dtype=x.dtype)
    entry = _extension().int4_linear if activation_bits == 8 else _extension().int4_linear_int16
    entry(x.data_ptr(), weight.codes.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr(), y.data_ptr(),
          _DTYPE_CODES[x.dtype], batch, weight.n, k, weight.group_size, int(num_threads), isa or "")
    return y


def quantize_activations(x: torch.Tensor, activation_bits: int = 8) -> torch.Tensor:
    """x [batch, k] as the kernel sees it: rounded per block of 32 to ints of `activation_bits`
    (scale max |x| / MAX_QUANT, round to nearest even), times the scale, in fp64."""
    batch, k = x.shape
    max_quant = MAX_QUANT[activation_bits]
    blocks = x.float().reshape(batch, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a true division, as in C++ (`c / amax` is torch's reciprocal times c: an ulp off at times)
    inverse = torch.where(amax > 0, torch.full_like(amax, max_quant).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inverse)
    return (codes.double() * (amax / max_quant).double()).reshape(batch, k)


def reference_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     group_size: int, activation_bits: int = 8) -> torch.Tensor:
    """int4_linear's arithmetic in plain fp64 torch over the canonical layout: with x' =
    quantize_activations(x), y = sum over groups of scale * <q - 8, x'> + (min + 8 scale) * sum(x)."""
    batch, k = x.shape
    n = qweight.shape[0]
    centered = unpack(qweight).double().reshape(n, -1, group_size) - CODE_CENTER
    scaled = (centered * scales.double()[..., None]).reshape(n, k)
    sums = x.double().reshape(batch, -1, group_size).sum(-1)
    centered_mins = mins.double() + CODE_CENTER * scales.double()
    return quantize_activations(x, activation_bits) @ scaled.T + sums @ centered_mins.T


# Calibration weight for default_num_threads: Llama-3.1-8B's gate|up shape, 38 MB packed, larger
# than common last-level caches, at batch 1 (decode: memory-bound).
_CALIBRATION_SHAPE = (14336, 4096)


@functools.cache
def default_num_threads() -> int:
    """The INT4 matmul's thread count: calibrated once per process (a few tenths of a second) on
    a decode-shaped call."""
    if not is_available():
        return 1
    n, k = _CALIBRATION_SHAPE
    tiles = n // TILE_ROWS
    codes = torch.full((tiles, k // BLOCK, CHUNKS, TILE_ROWS, 4), 0x5A, dtype=torch.uint8)  # values do not matter
    params = torch.ones(tiles, k // BLOCK, TILE_ROWS)
    weight = TiledInt4(codes, params, params, n, BLOCK)
    x = torch.randn(1, k)
    return calibrate_num_threads(lambda threads: int4_linear(x, weight, num_threads=threads))
