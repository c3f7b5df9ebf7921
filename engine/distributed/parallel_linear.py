"""Tensor-parallel weights behind the linear-method seam, and the layer store that makes them.

Q/K/V and gate/up are column-parallel as the sharded loader hands them out (each rank its own
output rows: nothing to exchange); O and down are row-parallel (each rank a slice of the input
columns) and sum their partial products over the ranks, one all-reduce each per layer; the LM
head is vocabulary-parallel (each rank its rows of the vocabulary) and gathers the logits. The
model calls `apply` as ever and never sees a rank."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.model.feed_forward import SwiGluMlp
from engine.model.llama import LayerStore, LayerWeights
from engine.quant import LinearMethod, LinearWeight
from engine.quant.base import WrappedWeight


class Collectives(Protocol):
    """The ranks' collectives, called in the same order on every rank."""

    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum over the ranks, in place."""

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on every rank -> [rows, world_size * cols], rank by rank."""


class RowParallelWeight(WrappedWeight):
    """This rank's input columns of a weight; the partial products summed over the ranks."""

    def __init__(self, inner: LinearWeight, collectives: Collectives) -> None:
        super().__init__(inner)
        self.method, self.collectives = inner.method, collectives

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(self.inner.apply(x).contiguous())

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "RowParallelWeight":
        return RowParallelWeight(self.inner.with_tensors(tensors), self.collectives)


class VocabParallelHead(WrappedWeight):
    """This rank's rows of the LM head (padded alike on every rank); the logits gathered and the
    padding dropped: [rows, vocab_size] on every rank."""

    def __init__(self, inner: LinearWeight, collectives: Collectives, vocab_ranges: list[tuple[int, int]]) -> None:
        super().__init__(inner)
        self.method, self.collectives, self.vocab_ranges = inner.method, collectives, vocab_ranges
        self.out_features = vocab_ranges[-1][1]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        gathered = self.collectives.all_gather_columns(self.inner.apply(x).contiguous())
        rows_per_rank = self.inner.out_features
        shards = [gathered[:, rank * rows_per_rank:rank * rows_per_rank + end - start]
                  for rank, (start, end) in enumerate(self.vocab_ranges)]
        return shards[0] if len(shards) == 1 else torch.cat(shards, dim=-1)

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "VocabParallelHead":
        return VocabParallelHead(self.inner.with_tensors(tensors), self.collectives, self.vocab_ranges)


class TensorParallelLayers(LayerStore):
    """Every layer resident, its O and down projections row-parallel, the LM head vocabulary-parallel."""

    def __init__(self, device: torch.device, collectives: Collectives, vocab_ranges: list[tuple[int, int]]) -> None:
        super().__init__(device)
        self.collectives, self.vocab_ranges = collectives, vocab_ranges

    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        layer = super().build(index, loaded, linear, dtype)
        layer.o_proj = RowParallelWeight(layer.o_proj, self.collectives)
        layer.mlp = SwiGluMlp(layer.mlp.gate_up, RowParallelWeight(layer.mlp.down, self.collectives))
        return layer

    def head(self, weight: LinearWeight) -> LinearWeight:
        return VocabParallelHead(weight, self.collectives, self.vocab_ranges)
