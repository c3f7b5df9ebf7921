"""A decoder layer's linear weights as one flat byte image (PIPO sec. 3.3's data merging).

Each weight object names the tensors it reads (`LinearWeight.tensors()`); the image lays them
out one after the other (scheduler.planning.image_layout: each on a 256-byte boundary, the
whole padded to 4 KiB), so a layer is one buffer in host memory, one file region on disk, one
read and one copy into a GPU buffer. `bind` turns any buffer holding the image back into
weight objects whose tensors are views into it: a streamed layer's weights in whichever ring
buffer it landed, with no copy and no allocation beyond the views.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from engine.quant import LinearWeight
from scheduler.planning import image_layout

LINEAR_NAMES = ("qkv", "o_proj", "gate_up", "down")  # LayerWeights' linear fields, in image order


@dataclass(frozen=True)
class ImageTensor:
    """One tensor of an image: `weight` is the linear (qkv, ...), `name` its tensor's name."""

    weight: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class LayerImage:
    """Where each tensor of one layer's linear weights sits in its image of `nbytes` bytes."""

    tensors: tuple[ImageTensor, ...]
    nbytes: int

    @classmethod
    def of(cls, weights: Mapping[str, LinearWeight]) -> "LayerImage":
        """The image layout of these weights, in the mapping's order (a whole layer: LINEAR_NAMES;
        a sliced MLP's streamed part: its gate/up and down)."""
        entries = [(name, key, t) for name, weight in weights.items() for key, t in weight.tensors().items()]
        offsets, nbytes = image_layout(t.numel() * t.element_size() for _, _, t in entries)
        return cls(tuple(ImageTensor(name, key, t.dtype, tuple(t.shape), offset)
                         for (name, key, t), offset in zip(entries, offsets)), nbytes)

    def write(self, weights: Mapping[str, LinearWeight], into: torch.Tensor) -> None:
        """Copy the weights' tensors into `into` (uint8, at least `nbytes`, any device); gaps are zeroed."""
        self._check_buffer(into)
        into[:self.nbytes].zero_()
        for entry, view in zip(self.tensors, self._views(into)):
            view.copy_(weights[entry.weight].tensors()[entry.name])

    def bind(self, templates: Mapping[str, LinearWeight], buffer: torch.Tensor) -> dict[str, LinearWeight]:
        """Weights like `templates` (same kinds and layouts) reading their tensors from `buffer`."""
        self._check_buffer(buffer)
        views: dict[str, dict[str, torch.Tensor]] = {name: {} for name in templates}
        for entry, view in zip(self.tensors, self._views(buffer)):
            views[entry.weight][entry.name] = view
        return {name: template.with_tensors(views[name]) for name, template in templates.items()}

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.tensors]

    def _check_buffer(self, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(f"a layer image needs a flat uint8 buffer of >= {self.nbytes} bytes, got "
                             f"{buffer.dtype} {list(buffer.shape)}")

    # ---- files ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "tensors": [
            {"weight": e.weight, "name": e.name, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
             "offset": e.offset} for e in self.tensors]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerImage":
        return cls(tuple(ImageTensor(t["weight"], t["name"], getattr(torch, t["dtype"]), tuple(t["shape"]), t["offset"])
                         for t in d["tensors"]), int(d["nbytes"]))


def meta_templates(weights: Mapping[str, LinearWeight]) -> dict[str, LinearWeight]:
    """The weights' kinds and layouts without their data (tensors on the meta device): what a
    streamed layer keeps between loads."""
    return {name: weights[name].with_tensors({key: torch.empty(t.shape, dtype=t.dtype, device="meta")
                                              for key, t in weights[name].tensors().items()})
            for name in weights}
