"""Group-wise INT4 weights (kernels/cpu/int4.py's layout) applied without widening them.

Small batches (decode) go through the C++ kernel, which reads the packed bytes once and unpacks
them in registers; larger ones (prefill) dequantize the weight in the compute dtype into one
scratch buffer that all of a model's INT4 weights share (the size of the largest) and run torch's
dense GEMM on it: measured on the 2-core VM, 4096x4096 at batch 16-256 took 1.05-1.8x the dense
GEMM that way, and 1.1-10x when the weight went through in tiles of rows (torch's GEMM ran a
[512, 4096] tile far below its speed on the whole matrix). GGUF Q4_0/Q4_1/Q4_K weights arrive
as `PackedInt4` and are used as they are; other GGUF quantized weights arrive as `KeepDense` and
stay dense; any other weight is quantized at load by round-to-nearest with each group's min and
scale (`--quantization int4`). A fused QKV or gate/up of several of these kinds is one weight per
run of a kind, their outputs concatenated (engine.quant.base.ConcatWeight).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.quant.base import ConcatWeight, LinearMethod, LinearWeight, register_linear_method
from engine.quant.dense import DenseWeight
from kernels.cpu import int4

DEFAULT_GROUP_SIZE = 32
# Rows of x up to which the packed kernel runs; above, the dequantized weight and a dense GEMM.
# The kernel unpacks each block once per 4 rows, so its cost grows with the batch while the
# GEMM's barely does: 4096x4096 on the 2-core VM (2 threads) took 0.5 / 1.4 / 5.5-7.9 / 11-12 ms
# at batch 1 / 4 / 8 / 16, against 10.6 ms for dequantize + fp32 GEMM at 16 (3.9 in bf16).
MAX_KERNEL_ROWS = 64


@dataclass(frozen=True)
class PackedInt4:
    """A weight already in int4.h's layout, as a loader read it (GGUF Q4_0/Q4_1/Q4_K blocks
    repacked exactly): the int4 method takes it as it is, with no quantization of its own."""

    qweight: torch.Tensor  # [n, k / 2] uint8
    scales: torch.Tensor  # [n, k / group_size] fp32
    mins: torch.Tensor  # [n, k / group_size] fp32
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        """The fp32 [n, k] matrix the blocks stand for."""
        return int4.dequantize(self.qweight, self.scales, self.mins, self.group_size)

    def take_rows(self, order: torch.Tensor) -> "PackedInt4":
        """Rows reordered (a row of W is a row of every field)."""
        return PackedInt4(self.qweight[order], self.scales[order], self.mins[order], self.group_size)

    @staticmethod
    def cat(parts: list["PackedInt4"]) -> "PackedInt4":
        """Stacked along the output dimension, as QKV and gate/up are fused."""
        return PackedInt4(*(torch.cat([getattr(p, name) for p in parts]) for name in ("qweight", "scales", "mins")),
                          parts[0].group_size)


@dataclass(frozen=True)
class KeepDense:
    """A weight a loader asks the int4 method to keep dense: one already quantized in a form int4's
    layout does not hold exactly (GGUF Q5/Q6/Q8, Q2_K/Q3_K), which quantizing again would blur."""

    weight: torch.Tensor  # [n, k], dequantized

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]


def fuse(parts: list) -> torch.Tensor | PackedInt4 | KeepDense | list:
    """Weights stacked along the output dimension, as QKV and gate/up are fused. Neighbours of one
    kind (packed with one group size, kept dense, plain) are concatenated; parts of several
    kinds stay a list of such runs, each of which the int4 method makes a weight of its own."""
    runs = [_cat(list(run)) for _, run in itertools.groupby(parts, key=_kind)]
    return runs[0] if len(runs) == 1 else runs


def _kind(weight) -> tuple:
    return type(weight), getattr(weight, "group_size", None)


def _cat(run: list) -> torch.Tensor | PackedInt4 | KeepDense:
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], PackedInt4):
        return PackedInt4.cat(run)
    if isinstance(run[0], KeepDense):
        return KeepDense(torch.cat([part.weight for part in run]))
    return torch.cat(run)


class DequantScratch:
    """The buffer the large-batch path dequantizes into: one per dtype, grown to the largest
    weight seen, shared by the weights of one linear method (the engine applies one at a time)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous [rows, cols] view of the buffer."""
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self._buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        return buffer[:rows * cols].view(rows, cols)


class Int4Weight(LinearWeight):
    method = "int4"

    def __init__(self, weight: int4.TiledInt4, bias: torch.Tensor | None, scratch: DequantScratch) -> None:
        self.weight = weight  # the CPU kernel's tiled layout
        self.bias = bias  # [out_features] in the compute dtype, or None
        self.scratch = scratch
        self.out_features = weight.n
        self.in_features = weight.k

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_KERNEL_ROWS:
            y = int4.int4_linear(x, self.weight, num_threads=torch.get_num_threads())
        else:
            dense = self.scratch.get(self.out_features, self.in_features, x.dtype)
            int4.dequantize_into(self.weight, dense, num_threads=torch.get_num_threads())
            y = F.linear(x, dense)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, in] matrix the packed weight stands for (what accuracy is measured against)."""
        qweight, scales, mins = self.weight.to_packed()
        return int4.dequantize(qweight, scales, mins, self.weight.group_size)

    @property
    def format(self) -> str:
        return "int4"

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


@register_linear_method("int4")
class Int4LinearMethod(LinearMethod):
    """Round-to-nearest INT4 at load, group size 32, for plain weights; a loader's PackedInt4 is
    taken as it is and its KeepDense kept dense. Runs on the host CPU's kernels."""

    name = "int4"
    takes_packed_int4 = True

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.group_size = group_size
        self.scratch = DequantScratch()

    def create_weight(self, weight, bias, *, dtype, device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"int4 weights run on the host CPU's kernels only, not on {device}")
        if isinstance(weight, list):  # fused parts of several kinds (fuse): one weight each
            sizes = [part.shape[0] for part in weight]
            biases = [None] * len(weight) if bias is None else list(bias.split(sizes))
            return ConcatWeight([self.create_weight(part, part_bias, dtype=dtype, device=device)
                                 for part, part_bias in zip(weight, biases)], self.name)
        bias = None if bias is None else bias.to(dtype)
        if isinstance(weight, KeepDense):
            return DenseWeight(weight.weight.to(dtype), bias)
        if isinstance(weight, PackedInt4):  # GGUF Q4 blocks: exact as they are
            packed, group_size = (weight.qweight, weight.scales, weight.mins), weight.group_size
        else:
            int4.check_group_size(self.group_size, weight.shape[1])
            packed, group_size = int4.quantize_rtn(weight, self.group_size), self.group_size
        return Int4Weight(int4.TiledInt4.from_packed(*packed, group_size), bias, self.scratch)
