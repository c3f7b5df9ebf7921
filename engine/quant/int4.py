"""Group-wise INT4 weights (kernels/cpu/int4.py's layout) applied without widening them.

The kernels are the device's (`INT4_KERNELS`, by device type; each keeps the packed weight in
the layout it reads): on the host CPU the C++ kernels over a tiled copy (integer dot products,
kernels/cpu/int4.h), with x quantized to int16 for decode-sized batches (MAX_INT16_ROWS); on CUDA
kernels/triton's W4A16 over the canonical layout, imported only there. Larger batches (prefill
chunks) dequantize the weight in the compute dtype into one scratch buffer that all of a model's
INT4 weights share (the size of the largest) and run the dense GEMM on it, or on the CPU with
`--int4-prefill int8` quantize x to int8 and stay on the packed kernel (engine.config.Int4Prefill). GGUF
Q4_0/Q4_1/Q4_K weights arrive as `PackedInt4` and are used as they are; other GGUF quantized
weights arrive as `KeepDense` and stay dense; any other weight is quantized at load by
round-to-nearest with each group's min and scale (`--quantization int4`). A fused QKV or gate/up
of several of these kinds is one weight per run of a kind, their outputs concatenated
(engine.quant.base.ConcatWeight).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.config import Int4Prefill
from engine.quant.base import ConcatWeight, LinearMethod, LinearWeight, register_linear_method
from engine.quant.dense import DenseWeight
from engine.registry import Registry
from kernels.cpu import int4

DEFAULT_GROUP_SIZE = 32
# Rows of x up to which the CPU kernel quantizes x to int16 (decode: memory-bound, so int16 costs
# nothing, and int8 there moved the embedded model's top-1 agreement to 95.8%). Above, an Int4Prefill
# path: dequantize (exact weights for torch's GEMM, whose rounding order follows the row count),
# int8 (4 products per instruction to int16's 2: about dense bf16's speed, perplexity +0.34% against
# int16 on the held text; benchmarks/results/int4_matmul.md and accuracy.md) or int16 (decode's own
# kernel at every row count: a row's bits whatever its chunk, for --batch-invariant).
MAX_INT16_ROWS = 64


@dataclass(frozen=True)
class PackedInt4:
    """A weight already in int4.h's layout, as a loader read it (GGUF Q4_0/Q4_1/Q4_K blocks
    repacked exactly): the int4 method takes it as it is, with no quantization of its own."""

    qweight: torch.Tensor  # [n, k / 2] uint8
    scales: torch.Tensor  # [n, k / group_size] fp32 (fp16 inside TritonInt4Kernels where exact)
    mins: torch.Tensor  # [n, k / group_size] fp32 (likewise)
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins))

    def to(self, device: torch.device | str) -> "PackedInt4":
        return PackedInt4(self.qweight.to(device), self.scales.to(device), self.mins.to(device), self.group_size)

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


def weight_rows(weight, start: int, end: int):
    """Output rows [start, end) of a loaded weight (a tensor, PackedInt4 or KeepDense), copied: the
    whole weight need not stay alive."""
    if isinstance(weight, PackedInt4):
        return PackedInt4(*(t[start:end].clone() for t in (weight.qweight, weight.scales, weight.mins)),
                          weight.group_size)
    if isinstance(weight, KeepDense):
        return KeepDense(weight.weight[start:end].clone())
    return weight[start:end].clone()


def weight_columns(weight, start: int, end: int):
    """Input columns [start, end) of a loaded weight, copied; a packed one only on its groups'
    boundaries (ValueError elsewhere)."""
    if isinstance(weight, PackedInt4):
        group = weight.group_size
        if start % group or end % group:
            raise ValueError(f"a packed INT4 weight is cut on its groups of {group} columns, not at "
                             f"[{start}, {end})")
        return PackedInt4(weight.qweight[:, start // 2:end // 2].contiguous(),
                          weight.scales[:, start // group:end // group].contiguous(),
                          weight.mins[:, start // group:end // group].contiguous(), group)
    if isinstance(weight, KeepDense):
        return KeepDense(weight.weight[:, start:end].contiguous())
    return weight[:, start:end].contiguous()


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
    """The buffer the large-batch path dequantizes into: one per device and dtype, grown to the
    largest weight seen, shared by the weights of one linear method (the engine applies one at a
    time; on a GPU the stream orders the uses)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous [rows, cols] view of the buffer."""
        buffer = self._buffers.get((device, dtype))
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self._buffers[device, dtype] = torch.empty(rows * cols, dtype=dtype, device=device)
        return buffer[:rows * cols].view(rows, cols)


class Int4Kernels(Protocol):
    """The matmul an Int4Weight runs on, for one device type, over a packed weight kept in the
    layout these kernels read (`prepare`'s result: anything with `nbytes`)."""

    def prepare(self, packed: PackedInt4, device: torch.device) -> Any:
        """The weight as these kernels keep it, on `device`."""

    def linear(self, x: torch.Tensor, weight: Any, scratch: DequantScratch) -> torch.Tensor:
        """x [num_tokens, in_features] -> x @ W^T [num_tokens, out_features] in x's dtype, no bias."""

    def to_packed(self, weight: Any) -> PackedInt4:
        """The canonical layout back (on the weight's device)."""


INT4_KERNELS: Registry[Int4Kernels] = Registry("int4 kernels")  # by torch device type


def create_int4_kernels(device: torch.device | str, prefill: str = Int4Prefill.DEQUANTIZE) -> Int4Kernels:
    """The kernels for `device`'s type, multiplying batches above their packed rows by `prefill`
    (Int4Prefill); ValueError naming those there are for a device without, or for a `prefill`
    they do not run."""
    device_type = torch.device(device).type
    if device_type not in INT4_KERNELS:
        raise ValueError(f"int4 weights have no kernels for device {device}; they run on "
                         f"{', '.join(INT4_KERNELS.names())}")
    if prefill not in list(Int4Prefill):
        raise ValueError(f"int4 prefill must be one of {', '.join(Int4Prefill)}, got {prefill!r}")
    return INT4_KERNELS.create(device_type, Int4Prefill(prefill))


@INT4_KERNELS.register("cpu")
class CpuInt4Kernels:
    """kernels/cpu's C++ kernels over the tiled copy, on the thread count calibrated for them
    (kernels.cpu.int4.default_num_threads, measured once per process); above MAX_INT16_ROWS the
    dequantized weight and torch's GEMM, or with prefill int8 the int8 kernel, register-blocked
    over rows, so a prefill chunk reads the weight from cache and never widens it."""

    def __init__(self, prefill: Int4Prefill = Int4Prefill.DEQUANTIZE) -> None:
        self.num_threads = int4.default_num_threads()
        self.prefill = prefill

    def prepare(self, packed: PackedInt4, device: torch.device) -> int4.TiledInt4:
        return int4.TiledInt4.from_packed(packed.qweight, packed.scales, packed.mins, packed.group_size)

    def linear(self, x: torch.Tensor, weight: int4.TiledInt4, scratch: DequantScratch) -> torch.Tensor:
        if x.shape[0] <= MAX_INT16_ROWS or self.prefill == Int4Prefill.INT16:
            return int4.int4_linear(x, weight, num_threads=self.num_threads, activation_bits=16)
        if self.prefill == Int4Prefill.INT8:
            # compute-bound: every core torch's own GEMM would use, not decode's memory-bound count
            return int4.int4_linear(x, weight, num_threads=torch.get_num_threads(), activation_bits=8)
        dense = scratch.get(weight.n, weight.k, x.dtype, x.device)
        int4.dequantize_into(weight, dense, num_threads=self.num_threads)
        return F.linear(x, dense)

    def to_packed(self, weight: int4.TiledInt4) -> PackedInt4:
        return PackedInt4(*weight.to_packed(), weight.group_size)


@INT4_KERNELS.register("cuda")
class TritonInt4Kernels:
    """kernels/triton's W4A16 over the canonical layout (imported here, so that the CPU engine runs
    without triton): the packed kernel up to its MAX_PACKED_ROWS, above that W dequantized into the
    method's scratch buffer and cuBLAS."""

    def __init__(self, prefill: Int4Prefill = Int4Prefill.DEQUANTIZE) -> None:
        if prefill != Int4Prefill.DEQUANTIZE:
            raise ValueError(f"int4 prefill {prefill} runs on the CPU's kernels; CUDA's dequantize")
        from kernels.triton import w4a16

        self.w4a16 = w4a16

    def prepare(self, packed: PackedInt4, device: torch.device) -> PackedInt4:
        return PackedInt4(packed.qweight.to(device), narrowed(packed.scales).to(device),
                          narrowed(packed.mins).to(device), packed.group_size)

    def linear(self, x: torch.Tensor, weight: PackedInt4, scratch: DequantScratch) -> torch.Tensor:
        dense = None
        if x.shape[0] > self.w4a16.MAX_PACKED_ROWS:  # only then: decode alone never allocates it
            dense = scratch.get(*weight.shape, x.dtype, x.device)
        return self.w4a16.w4a16_linear(x, weight.qweight, weight.scales, weight.mins, weight.group_size,
                                       dense=dense)

    def to_packed(self, weight: PackedInt4) -> PackedInt4:
        return PackedInt4(weight.qweight, weight.scales.float(), weight.mins.float(), weight.group_size)


def narrowed(params: torch.Tensor) -> torch.Tensor:
    """Scales or mins in fp16 where every value survives it (GGUF Q4_0/Q4_1 store fp16, so theirs
    do), else as they are (fp32): half the bytes the W4A16 kernel reads besides the codes (at group
    size 32, 4 bytes a group against 16 of codes), and never a changed weight."""
    half = params.half()
    return half if torch.equal(half.float(), params) else params


class Int4Weight(LinearWeight):
    method = "int4"

    def __init__(self, packed: PackedInt4, bias: torch.Tensor | None, scratch: DequantScratch,
                 kernels: Int4Kernels, device: torch.device) -> None:
        self.kernels = kernels
        self.weight = kernels.prepare(packed, device)  # in the kernels' own layout
        self.bias = bias  # [out_features] in the compute dtype, or None
        self.scratch = scratch
        self.out_features, self.in_features = packed.shape

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self.weight, self.scratch)
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, in] matrix the packed weight stands for (what accuracy is measured against)."""
        return self.kernels.to_packed(self.weight).dequantize()

    @property
    def format(self) -> str:
        return "int4"

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def tensors(self) -> dict[str, torch.Tensor]:
        # the kernels' own layout (a frozen dataclass of tensors and ints: TiledInt4, PackedInt4)
        tensors = {f.name: getattr(self.weight, f.name) for f in dataclasses.fields(self.weight)
                   if isinstance(getattr(self.weight, f.name), torch.Tensor)}
        return tensors if self.bias is None else {**tensors, "bias": self.bias}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "Int4Weight":
        other = copy.copy(self)
        other.weight = dataclasses.replace(self.weight, **{k: v for k, v in tensors.items() if k != "bias"})
        other.bias = tensors.get("bias")
        return other


@register_linear_method("int4")
class Int4LinearMethod(LinearMethod):
    """Round-to-nearest INT4 at load, group size 32, for plain weights; a loader's PackedInt4 is
    taken as it is and its KeepDense kept dense. Runs on the kernels INT4_KERNELS names for the
    device (the host CPU's C++ kernels, Triton's on CUDA)."""

    name = "int4"
    takes_packed_int4 = True

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE, prefill: Int4Prefill = Int4Prefill.DEQUANTIZE) -> None:
        self.group_size = group_size
        self.prefill = prefill
        self.scratch = DequantScratch()

    def create_weight(self, weight, bias, *, dtype, device, layout_device=None):
        # before any work: a device without kernels fails here
        kernels = create_int4_kernels(layout_device or device, self.prefill)
        if isinstance(weight, list):  # fused parts of several kinds (fuse): one weight each
            sizes = [part.shape[0] for part in weight]
            biases = [None] * len(weight) if bias is None else list(bias.split(sizes))
            return ConcatWeight([self.create_weight(part, part_bias, dtype=dtype, device=device,
                                                    layout_device=layout_device)
                                 for part, part_bias in zip(weight, biases)], self.name)
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        if isinstance(weight, KeepDense):  # int16 prefill: a dense part keeps decode's GEMV as well
            return DenseWeight(weight.weight.to(device=device, dtype=dtype), bias,
                               row_invariant=self.prefill == Int4Prefill.INT16)
        if not isinstance(weight, PackedInt4):  # GGUF Q4 blocks are exact as they are
            int4.check_group_size(self.group_size, weight.shape[1])
            weight = PackedInt4(*int4.quantize_rtn(weight, self.group_size), self.group_size)
        return Int4Weight(weight, bias, self.scratch, kernels, torch.device(device))
