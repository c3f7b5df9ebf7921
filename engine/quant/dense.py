"""Dense weights (fp32, bf16 or fp16) applied with torch's own GEMM."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.quant.base import LinearMethod, LinearWeight, register_linear_method


class DenseWeight(LinearWeight):
    method = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight  # [out_features, in_features]
        self.bias = bias  # [out_features] or None
        self.out_features, self.in_features = weight.shape

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def format(self) -> str:
        return str(self.weight.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        tensors = (self.weight,) if self.bias is None else (self.weight, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)


@register_linear_method("dense")
class DenseLinearMethod(LinearMethod):
    """The weight as loaded, cast to the compute dtype and moved to the device."""

    name = "dense"

    def create_weight(self, weight, bias, *, dtype, device):
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        return DenseWeight(weight.to(device=device, dtype=dtype), bias)
