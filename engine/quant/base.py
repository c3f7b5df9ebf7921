"""The linear-method seam: every matmul of the model goes through a weight object.

A `LinearMethod` turns a loaded weight matrix into a `LinearWeight` in its own format (dense or
packed INT4; engine/runtime wraps them as streamed or sliced weights), and the weight applies
itself: `apply(x) -> y = x @ W^T (+ bias)`. The model code only ever calls `apply`, so a new
format or a new place for a weight plugs in here and the model does not change.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
import torch

from engine.registry import Registry
from scheduler.planning.tiers import Tier


class LinearWeight(ABC):
    """One linear layer's weight (fused QKV or gate/up included), ready to apply."""

    method: str  # the name of the LinearMethod that made it
    out_features: int
    in_features: int

    @abstractmethod
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features], in x's dtype."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight (and bias) occupy where they live."""

    @property
    @abstractmethod
    def format(self) -> str:
        """How the numbers are stored, for reports: "float32", "bfloat16", "int4", ..."""

    @property
    def parts(self) -> tuple["LinearWeight", ...]:
        """The weights of one format each that this one is made of, for reports: itself."""
        return (self,)

    # Where the weight is stored: resident on the GPU, or in host memory / on disk for a
    # weight streamed in before use (engine/offload/ring.py).
    tier: Tier = Tier.GPU

    def placed_parts(self) -> tuple[tuple["LinearWeight", str], ...]:
        """Each part with the tier it is stored in, for reports: here all in the weight's tier (a
        sliced MLP's parts, engine/offload/slicing/sliced_mlp.py, live in several)."""
        return tuple((part, self.tier) for part in self.parts)

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the weight reads when applied, by a name stable for its kind: what a layer
        image stores (engine/weights/layer_image.py)."""

    @abstractmethod
    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "LinearWeight":
        """The same weight reading `tensors` (same names, shapes and dtypes as `tensors()`; views
        into a streamed layer's buffer) instead of its own."""


class WrappedWeight(LinearWeight):
    """A weight that stands for `inner` somewhere else (computed on the host, streamed into a
    buffer): its shape, format, bytes, parts and tensors are the inner weight's."""

    def __init__(self, inner: LinearWeight) -> None:
        self.inner = inner
        self.out_features, self.in_features = inner.out_features, inner.in_features

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(x)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def format(self) -> str:
        return self.inner.format

    @property
    def parts(self) -> tuple[LinearWeight, ...]:
        return self.inner.parts

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.inner.tensors()


class ConcatWeight(LinearWeight):
    """A fused weight (QKV, gate/up) whose parts are stored in different formats, as when a
    GGUF file holds Q and K in 4 bits and V in 6: each part applies to x on its own and the
    outputs are concatenated, [num_tokens, sum of the parts' out_features]."""

    def __init__(self, parts: list[LinearWeight], method: str) -> None:
        self._parts = tuple(parts)
        self.method = method
        self.out_features = sum(part.out_features for part in parts)
        self.in_features = parts[0].in_features

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.apply(x) for part in self._parts], dim=-1)

    @property
    def parts(self) -> tuple[LinearWeight, ...]:
        return self._parts

    @property
    def format(self) -> str:
        return "+".join(dict.fromkeys(part.format for part in self._parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self._parts)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{i}.{name}": t for i, part in enumerate(self._parts) for name, t in part.tensors().items()}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "ConcatWeight":
        parts = [part.with_tensors({name: tensors[f"{i}.{name}"] for name in part.tensors()})
                 for i, part in enumerate(self._parts)]
        return ConcatWeight(parts, self.method)


class LinearMethod(ABC):
    """Makes weight objects of one format from dense [out_features, in_features] matrices."""

    name: str
    # Whether create_weight also takes loaders' packed 4-bit weights (engine.quant.int4.PackedInt4)
    # as they are; loaders dequantize them for a method that does not.
    takes_packed_int4: bool = False

    @abstractmethod
    def create_weight(self, weight: torch.Tensor, bias: torch.Tensor | None, *, dtype: torch.dtype,
                      device: torch.device, layout_device: torch.device | None = None) -> LinearWeight:
        """Wrap `weight` [out, in] and `bias` [out] (or None), computing in `dtype` on `device`;
        laid out for `layout_device`'s kernels when given (a streamed weight stored on the host
        and computed, after its copy, on the GPU), else for `device`'s."""


LINEAR_METHODS: Registry[LinearMethod] = Registry("linear method")
# Class decorator: make a linear method available to `create_linear_method` as `name`.
register_linear_method = LINEAR_METHODS.register
linear_method_names = LINEAR_METHODS.names


def create_linear_method(name: str, **options) -> LinearMethod:
    """`options`: the method's own keyword arguments (int4's `prefill`)."""
    return LINEAR_METHODS.create(name, **options)
