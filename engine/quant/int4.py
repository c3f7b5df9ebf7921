"""Group-wise INT4 weights (kernels/cpu/int4.py's layout) applied without widening them.

The kernels are the device's (`INT4_KERNELS`, by the device type of the packed tensors): the
host CPU's C++ kernels, or kernels/triton's W4A16 on CUDA, imported only there. Either way small
batches (decode) go through a kernel that reads the packed bytes once and unpacks them in
registers; larger ones (prefill) dequantize the weight in the compute dtype into one scratch
buffer that all of a model's INT4 weights share (the size of the largest) and run torch's dense
GEMM on it. With the C++ kernels on the 2-core VM, 4096x4096 at batch 16-256 took 1.05-1.8x
the dense GEMM that way, and 1.1-10x when the weight went through in tiles of rows (torch's GEMM
ran a [512, 4096] tile far below its speed on the whole matrix). GGUF Q4_0/Q4_1 weights arrive
as `PackedInt4` and are used as they are; any other weight is quantized at load by
round-to-nearest with each group's min and scale (`--quantization int4`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.quant.base import LinearMethod, LinearWeight, register_linear_method
from engine.registry import Registry
from kernels.cpu import int4

DEFAULT_GROUP_SIZE = 32
# Rows of x up to which the packed kernel runs; above, the dequantized weight and a dense GEMM.
# The kernel unpacks each block once per 4 rows, so its cost grows with the batch while the
# GEMM's barely does: 4096x4096 on the 2-core VM (2 threads) took 0.5 / 1.4 / 5.5-7.9 / 11-12 ms
# at batch 1 / 4 / 8 / 16, against 10.6 ms for dequantize + fp32 GEMM at 16 (3.9 in bf16).
MAX_KERNEL_ROWS = 8


@dataclass(frozen=True)
class PackedInt4:
    """A weight already in int4.h's layout, as a loader read it (GGUF Q4_0/Q4_1 blocks repacked
    exactly): the int4 method takes it as it is, with no quantization of its own."""

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


def fuse(parts: list) -> torch.Tensor | PackedInt4:
    """Weights stacked along the output dimension: packed if every part is, else dense."""
    if all(isinstance(p, PackedInt4) for p in parts) and len({p.group_size for p in parts}) == 1:
        return PackedInt4.cat(parts)
    return torch.cat([p.dequantize() if isinstance(p, PackedInt4) else p for p in parts])


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
    """The matmul an Int4Weight runs on: a packed kernel for small batches and dequantize + dense
    GEMM for large ones, for the device the packed tensors live on."""

    def linear(self, x: torch.Tensor, weight: "Int4Weight") -> torch.Tensor:
        """x [num_tokens, in_features] -> x @ W^T [num_tokens, out_features] in x's dtype, no bias."""


INT4_KERNELS: Registry[Int4Kernels] = Registry("int4 kernels")  # by torch device type


def create_int4_kernels(device: torch.device | str) -> Int4Kernels:
    """The kernels for `device`'s type; ValueError naming those there are for a device without."""
    device_type = torch.device(device).type
    if device_type not in INT4_KERNELS:
        raise ValueError(f"int4 weights have no kernels for device {device}; they run on "
                         f"{', '.join(INT4_KERNELS.names())}")
    return INT4_KERNELS.create(device_type)


@INT4_KERNELS.register("cpu")
class CpuInt4Kernels:
    """kernels/cpu's C++ kernels, on torch's intra-op thread count."""

    def linear(self, x: torch.Tensor, weight: "Int4Weight") -> torch.Tensor:
        if x.shape[0] <= MAX_KERNEL_ROWS:
            return int4.int4_linear(x, weight.qweight, weight.scales, weight.mins, weight.group_size,
                                    num_threads=torch.get_num_threads())
        dense = weight.scratch.get(weight.out_features, weight.in_features, x.dtype, x.device)
        int4.dequantize_into(weight.qweight, weight.scales, weight.mins, weight.group_size, dense,
                             num_threads=torch.get_num_threads())
        return F.linear(x, dense)


@INT4_KERNELS.register("cuda")
class TritonInt4Kernels:
    """kernels/triton's W4A16 (imported here, so that the CPU engine runs without triton): the
    packed kernel up to its MAX_PACKED_ROWS, above that W dequantized into the method's scratch
    buffer and cuBLAS."""

    def __init__(self) -> None:
        from kernels.triton import w4a16

        self.w4a16 = w4a16

    def linear(self, x: torch.Tensor, weight: "Int4Weight") -> torch.Tensor:
        dense = None
        if x.shape[0] > self.w4a16.MAX_PACKED_ROWS:  # only then: decode alone never allocates it
            dense = weight.scratch.get(weight.out_features, weight.in_features, x.dtype, x.device)
        return self.w4a16.w4a16_linear(x, weight.qweight, weight.scales, weight.mins, weight.group_size,
                                       dense=dense)


class Int4Weight(LinearWeight):
    method = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, scratch: DequantScratch, kernels: Int4Kernels | None = None) -> None:
        self.qweight, self.scales, self.mins = qweight, scales, mins  # int4.h's layout
        self.group_size = group_size
        self.bias = bias  # [out_features] in the compute dtype, or None
        self.scratch = scratch
        # None: the kernels of the device the packed tensors live on
        self.kernels = create_int4_kernels(qweight.device) if kernels is None else kernels
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * 2

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.linear(x, self)
        return y if self.bias is None else y + self.bias

    @property
    def format(self) -> str:
        return "int4"

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.mins] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)


@register_linear_method("int4")
class Int4LinearMethod(LinearMethod):
    """Round-to-nearest INT4 at load, group size 32; runs on the kernels INT4_KERNELS names for
    the device (the host CPU's C++ kernels, Triton's on CUDA)."""

    name = "int4"
    takes_packed_int4 = True

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.group_size = group_size
        self.scratch = DequantScratch()

    def create_weight(self, weight, bias, *, dtype, device):
        kernels = create_int4_kernels(device)  # before any work: a device without kernels fails here
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        if isinstance(weight, PackedInt4):  # GGUF Q4 blocks: exact as they are
            packed, group_size = (weight.qweight, weight.scales, weight.mins), weight.group_size
        else:
            int4.check_group_size(self.group_size, weight.shape[1])
            packed, group_size = int4.quantize_rtn(weight, self.group_size), self.group_size
        qweight, scales, mins = (tensor.to(device) for tensor in packed)
        return Int4Weight(qweight, scales, mins, group_size, bias, self.scratch, kernels)
