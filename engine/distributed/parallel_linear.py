"""Tensor-parallel weights behind the linear-method seam, and the layer store that makes them.

Q/K/V and gate/up (every expert's too) are column-parallel as the sharded loader hands them out
(each rank its own output rows: nothing to exchange); O and down are row-parallel (each rank a
slice of the input columns): O sums its partial product over the ranks, the MLP its output, one
all-reduce each per layer; the LM head is vocabulary-parallel (each rank its rows of the
vocabulary) and gathers the logits. The model calls `apply` as ever and never sees a rank."""
from __future__ import annotations

from typing import Protocol

import torch

from engine.model_config import ModelConfig
from engine.model.feed_forward import FeedForward, SiluMul
from engine.model.layer_weights import LayerWeights
from engine.model.layer_store import DelegatingLayerStore, LayerStore
from engine.model.moe import MoeLayerWeights
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


class ReducedFeedForward:
    """A rank's MLP over its intermediate units (a dense MLP, its CPU/GPU slices, or its share of
    every expert: each is linear in its units' outputs), summed over the ranks: one all-reduce."""

    def __init__(self, inner: FeedForward, collectives: Collectives) -> None:
        self.inner, self.collectives = inner, collectives

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        return self.collectives.all_reduce(self.inner.apply(x, silu_mul).contiguous())

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        return self.inner.linear_weights()


class TensorParallelLayers(DelegatingLayerStore):
    """Another store's layers (resident, streamed, sliced; dense or MoE), each with its O
    projection row-parallel and its MLP's output summed over the ranks; the LM head
    vocabulary-parallel. Everything else is the inner store's."""

    def __init__(self, inner: LayerStore, collectives: Collectives, vocab_ranges: list[tuple[int, int]]) -> None:
        super().__init__(inner)
        self.collectives, self.vocab_ranges = collectives, vocab_ranges

    @property
    def graph_capturable(self) -> bool:
        return False  # the all-reduces run outside CUDA graphs (not captured with NCCL here)

    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        return self._parallel(self.inner.build(index, loaded, linear, dtype))

    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        return self._parallel(self.inner.build_moe_layer(index, loaded, config, linear, dtype))

    def _parallel(self, layer):
        layer.o_proj = RowParallelWeight(layer.o_proj, self.collectives)
        layer.mlp = ReducedFeedForward(layer.mlp, self.collectives)
        return layer

    def head(self, weight: LinearWeight) -> LinearWeight:
        return VocabParallelHead(self.inner.head(weight), self.collectives, self.vocab_ranges)
