"""What the model asks of the place its decoder layers' weights live: the `LayerStore` interface,
and the store that keeps every layer resident. The parts that keep weights off the GPU
(engine/offload/) implement it; the model code never changes when a layer's place does."""
from __future__ import annotations

import torch

from engine.model.layer_weights import LayerWeights
from engine.quant import LinearMethod, LinearWeight


class LayerStore:
    """Where decoder layers' weights live and how a forward gets at them. This one keeps every
    layer resident on the GPU; engine/offload/layer_store.py places them by a ModelPlan
    (streamed whole, or with the MLP sliced across the CPU and the GPU).

    A forward `acquire`s each layer before its first stage and `release`s it after its last (with
    two sub-batches, after the second's), layers in order; both run where the GPU's work
    runs."""

    # Whether every layer's weights stay in the tensors they were built in for the model's life
    # (engine/model/native.py keeps pointers to them); streamed layers come and go.
    weights_stay_put = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def graph_capturable(self) -> bool:
        """Whether a forward over these layers may be recorded as a CUDA graph and replayed
        (engine/runtime/cuda_graphs.py): only where every weight stays where it was built."""
        return self.weights_stay_put

    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        """Layer `index`'s weights from what the loader gave."""
        return LayerWeights.from_loaded(loaded, linear, dtype, self.device)

    def head(self, weight: LinearWeight) -> LinearWeight:
        """The LM head as the forward applies it (split over tensor-parallel ranks: gathered)."""
        return weight

    def stage_input(self, token_ids: torch.Tensor, embed) -> torch.Tensor:
        """The first layer's input: the tokens embedded (a later pipeline stage: the previous
        stage's output)."""
        return embed(token_ids)

    def stage_output(self, hidden: torch.Tensor, output_rows: torch.Tensor, head) -> torch.Tensor:
        """The last layer's output as the forward returns it: the logits of `output_rows` (an
        earlier pipeline stage: handed on whole, no logits)."""
        return head(hidden, output_rows)

    def start(self) -> None:
        """Every layer is built: allocate what serving needs."""

    def use_gpu(self, gpu) -> None:
        """The engine.device.queues.GpuQueue the forward's GPU work runs on,
        given before any layer is built (a sliced MLP hands its CPU part through it)."""

    def acquire(self, layer: int) -> None:
        """The layer's weights are about to be used on the GPU."""

    def release(self, layer: int) -> None:
        """The forward is done with the layer's weights."""

    def recover(self) -> None:
        """After a failed forward (layers acquired and never released): start over."""

    def begin_serving(self) -> None:
        """Start-up forwards (profiling) are over: what the store measures from here is traffic."""

    def between_forwards(self) -> None:
        """A forward is done and the next not begun (the engine thread, the GPU idle): what a
        store changes in where weights live, it changes here."""

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes of weight memory beside the weights themselves (streaming buffers), by (format, tier)."""
        return {}

    def close(self) -> None:
        """Stop threads and close files."""


class DelegatingLayerStore(LayerStore):
    """Another store's layers, with some of what the forward asks changed by a subclass (split over
    tensor-parallel ranks, cut into pipeline stages); everything else is the inner store's."""

    def __init__(self, inner: LayerStore) -> None:
        super().__init__(inner.device)
        self.inner = inner
        self.weights_stay_put = inner.weights_stay_put

    @property
    def graph_capturable(self) -> bool:
        return self.inner.graph_capturable

    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        return self.inner.build(index, loaded, linear, dtype)

    def build_moe_layer(self, index: int, loaded: dict, config, linear: LinearMethod, dtype: torch.dtype):
        return self.inner.build_moe_layer(index, loaded, config, linear, dtype)

    def head(self, weight: LinearWeight) -> LinearWeight:
        return self.inner.head(weight)

    def stage_input(self, token_ids: torch.Tensor, embed) -> torch.Tensor:
        return self.inner.stage_input(token_ids, embed)

    def stage_output(self, hidden: torch.Tensor, output_rows: torch.Tensor, head) -> torch.Tensor:
        return self.inner.stage_output(hidden, output_rows, head)

    def start(self) -> None:
        self.inner.start()

    def use_gpu(self, gpu) -> None:
        self.inner.use_gpu(gpu)

    def acquire(self, layer: int) -> None:
        self.inner.acquire(layer)

    def release(self, layer: int) -> None:
        self.inner.release(layer)

    def recover(self) -> None:
        self.inner.recover()

    def begin_serving(self) -> None:
        self.inner.begin_serving()

    def between_forwards(self) -> None:
        self.inner.between_forwards()

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        return self.inner.extra_weight_bytes()

    def close(self) -> None:
        self.inner.close()
