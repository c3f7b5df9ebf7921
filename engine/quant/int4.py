"""Group-wise INT4 weights (kernels/cpu/int4.py's layout) applied without widening them.

Small batches (decode) go through the C++ kernel, which reads the packed bytes once and unpacks
them in registers; larger ones (prefill) dequantize row tiles of the weight into a buffer that
fits the caches and run torch's dense GEMM on each, so a prefill never pays for a whole fp32
matrix. Weights arrive dense today and are quantized at load by round-to-nearest with each
group's min and scale (`--quantization int4`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.base import LinearMethod, LinearWeight, register_linear_method
from kernels.cpu import int4

DEFAULT_GROUP_SIZE = 32
# Rows of x up to which the packed kernel runs; above, dequantized tiles and a dense GEMM. The
# kernel unpacks each block once per 4 rows, so its cost grows with the batch while the GEMM's
# barely does (first measurement on the 2-core VM: faster than fp32 dense at batch 1-4, slower
# at 16); to be set by benchmarks/int4_matmul.py.
MAX_KERNEL_ROWS = 8
# Dequantized fp32 rows per tile of the large-batch path: a tile of 4 MiB stays in the caches.
TILE_BYTES = 4 << 20


class Int4Weight(LinearWeight):
    method = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> None:
        self.qweight, self.scales, self.mins = qweight, scales, mins  # int4.h's layout
        self.group_size = group_size
        self.bias = bias  # [out_features] in the compute dtype, or None
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * 2

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_KERNEL_ROWS:
            y = int4.int4_linear(x, self.qweight, self.scales, self.mins, self.group_size,
                                 num_threads=torch.get_num_threads())
        else:
            y = self._tiled(x)
        return y if self.bias is None else y + self.bias

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T one dequantized tile of output rows at a time."""
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        rows_per_tile = max(1, TILE_BYTES // (4 * self.in_features))
        for start in range(0, self.out_features, rows_per_tile):
            end = min(start + rows_per_tile, self.out_features)
            tile = int4.dequantize(self.qweight[start:end], self.scales[start:end], self.mins[start:end],
                                   self.group_size)
            y[:, start:end] = F.linear(x, tile.to(x.dtype))
        return y

    @property
    def format(self) -> str:
        return "int4"

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.mins] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in tensors)


@register_linear_method("int4")
class Int4LinearMethod(LinearMethod):
    """Round-to-nearest INT4 at load, group size 32; runs on the host CPU's kernels."""

    name = "int4"

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.group_size = group_size

    def create_weight(self, weight, bias, *, dtype, device):
        if torch.device(device).type != "cpu":
            raise ValueError(f"int4 weights run on the host CPU's kernels only, not on {device}")
        int4.check_group_size(self.group_size, weight.shape[1])
        qweight, scales, mins = int4.quantize_rtn(weight, self.group_size)
        return Int4Weight(qweight, scales, mins, self.group_size, None if bias is None else bias.to(dtype))
