"""Dense weights (fp32, bf16 or fp16) applied with torch's own GEMM, or, for the few rows of a
decode step on the CPU, with kernels/cpu's GEMV, which reads a weight up to about three times as
fast as torch's bf16 GEMV (docs/benchmarks.md, "Measurements behind code choices")."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.base import LinearMethod, LinearWeight, register_linear_method
from kernels import cpu as cpu_kernels
from kernels.cpu import int4 as int4_kernels


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether kernels/cpu's GEMV takes x's rows (a few at a time) against `weight`."""
    return (x.is_cpu and x.dim() == 2 and weight.shape[1] % cpu_kernels.DENSE_LINEAR_K_MULTIPLE == 0
            and weight.is_contiguous() and cpu_kernels.is_available())


class DenseWeight(LinearWeight):
    method = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, row_invariant: bool = False) -> None:
        self.weight = weight  # [out_features, in_features]
        self.bias = bias  # [out_features] or None
        self.out_features, self.in_features = weight.shape
        # every row count through the GEMV, a few rows at a time: a row's bits whatever its batch
        self.row_invariant = row_invariant

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        num_rows, max_rows = x.shape[0], cpu_kernels.DENSE_LINEAR_MAX_ROWS
        if num_rows and (num_rows <= max_rows or self.row_invariant) and _gemv_fits(x, self.weight):
            if num_rows <= max_rows:  # a decode step's rows: one call, no concatenation
                return self._gemv(x)
            return torch.cat([self._gemv(rows) for rows in x.split(max_rows)])
        return F.linear(x, self.weight, self.bias)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        # memory-bound like the int4 matmul: its calibrated thread count, capped at the calling
        # thread's torch threads so the testbed's GPU thread keeps to its own cores
        num_threads = min(int4_kernels.default_num_threads(), torch.get_num_threads())
        y = cpu_kernels.dense_linear(x, self.weight, num_threads).to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def format(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight} if self.bias is None else {"weight": self.weight, "bias": self.bias}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "DenseWeight":
        return DenseWeight(tensors["weight"], tensors.get("bias"), self.row_invariant)


@register_linear_method("dense")
class DenseLinearMethod(LinearMethod):
    """The weight as loaded, cast to the compute dtype and moved to the device."""

    name = "dense"

    def __init__(self, row_invariant: bool = False) -> None:
        self.row_invariant = row_invariant  # DenseWeight's: the GEMV at every row count

    def create_weight(self, weight, bias, *, dtype, device, layout_device=None):  # one layout everywhere
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        return DenseWeight(weight.to(device=device, dtype=dtype), bias, self.row_invariant)
