"""A decoder layer's MLP as one part with one `apply`: a dense SwiGLU MLP here; routed experts
(engine/model/moe.py) and MLPs sliced across the CPU and the GPU (engine/offload/slicing/sliced_mlp.py)
are other parts of the same shape."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from engine.quant import LinearWeight
from engine.quant.int4 import fuse

SiluMul = Callable[[torch.Tensor], torch.Tensor]  # gate_up [rows, 2 * inter] -> silu(gate) * up
Make = Callable[..., LinearWeight]  # (weight, bias=None) -> the linear method's weight object


class FeedForward(Protocol):
    """What a decoder layer does after its post-attention norm."""

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        """x [num_tokens, hidden] (normalized) -> [num_tokens, hidden]"""

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        """Every weight object it applies, for reports."""


class SwiGluMlp:
    """down(silu(gate(x)) * up(x)), gate and up fused: a dense layer's MLP, one expert, or a shared expert."""

    def __init__(self, gate_up: LinearWeight, down: LinearWeight) -> None:
        self.gate_up = gate_up  # [2 * intermediate, hidden]
        self.down = down  # [hidden, intermediate]

    @classmethod
    def from_loaded(cls, w: dict, make: Make, prefix: str = "") -> "SwiGluMlp":
        """From a loader's layer: the MLP whose keys start with `prefix` ("experts.3.", ...)."""
        return cls(make(fuse([w[f"{prefix}gate_proj"], w[f"{prefix}up_proj"]])), make(w[f"{prefix}down_proj"]))

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        return self.down.apply(silu_mul(self.gate_up.apply(x)))

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        return (self.gate_up, self.down)
