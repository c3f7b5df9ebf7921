"""PIPO's weight-streaming pipeline (sec. 3.1-3.3, Alg. 1): decoder layers kept in host memory or
on disk are loaded into a ring of preallocated accelerator buffers while earlier layers compute.

`StreamedLayers` is the model's `LayerStore` under a `WeightPlacement`. Resident layers are built
on the accelerator as usual. A streamed layer is built on the host, written as one layer image
(engine/weights/layer_image.py) into a host buffer (pinned on CUDA) or into its file in the
offload directory, and its linear weights become `StreamedWeight`s: the model calls `apply` as
ever, and they apply whatever weights the layer's current buffer holds.

One transfer thread (PIPO's thread pool runs one weight load at a time) loads the streamed
layers in the order forwards use them, round and round across forwards, load j into buffer
j % num_buffers once the layer that used it was released: a host layer is one multi-threaded
copy; a disk layer is read block by block with O_DIRECT by several threads into an aligned host
staging buffer, each block copied on as it lands. `acquire` waits for the layer's load (the
pipeline's stall, measured), `release` frees its buffer for the next load. The buffers hold as
many layers as a forward uses at once (two under Neo's two-batch forward), plus one for the
performance-optimised pipeline's preload. Nothing is allocated while serving but the tensor views
a load binds.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.execution.cores import CoreAssignment
from engine.execution.transfer import CopyEngine, create_copy_engine, pin_to
from engine.model.config import ConfigError
from engine.model.llama import LayerStore, LayerWeights
from engine.quant import LinearMethod, LinearWeight
from engine.weights.convert import build_host_layer
from engine.weights.direct_io import DirectReader, OpenFile
from engine.weights.layer_files import LayerFiles
from engine.weights.layer_image import LINEAR_NAMES, LayerImage, meta_templates
from scheduler.placement import TIER_ACCELERATOR, TIER_DISK, TIER_HOST, WeightPlacement

logger = logging.getLogger(__name__)

BUFFER_FORMAT = "layer buffers"  # weight_bytes' format label for the ring
# How often a waiting acquire checks that the transfer thread is still alive.
WAIT_POLL_S = 1.0
NUM_STAGING_BUFFERS = 2  # scheduler.placement.planner.NUM_STAGING_BUFFERS


class _Binding:
    """Which weights a streamed layer's StreamedWeights apply: its buffer's, while acquired."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.current: dict[str, LinearWeight] | None = None


class StreamedWeight(LinearWeight):
    """A streamed layer's linear weight: applies the weights bound from the buffer its layer was
    loaded into. Using it outside acquire/release is an error, never a silent stale read."""

    method = "streamed"

    def __init__(self, binding: _Binding, name: str, template: LinearWeight, tier: str) -> None:
        self.binding = binding
        self.name = name
        self.template = template  # kind and layout, tensors on the meta device
        self.tier = tier
        self.out_features, self.in_features = template.out_features, template.in_features

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        current = self.binding.current
        if current is None:
            raise RuntimeError(f"layer {self.binding.layer}'s weights are not on the accelerator: a forward must "
                               f"acquire a streamed layer before using it")
        return current[self.name].apply(x)

    @property
    def nbytes(self) -> int:
        return self.template.nbytes

    @property
    def format(self) -> str:
        return self.template.format

    @property
    def parts(self) -> tuple[LinearWeight, ...]:
        return self.template.parts

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.template.tensors()

    def with_tensors(self, tensors):
        return self.template.with_tensors(tensors)


@dataclass
class _Buffer:
    """One accelerator layer buffer of the ring."""

    data: torch.Tensor  # uint8 [buffer bytes]
    free: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    layer: int | None = None
    weights: dict[str, LinearWeight] | None = None
    error: BaseException | None = None
    engine_state: dict[str, Any] = field(default_factory=dict)  # the copy engine's events


@dataclass
class _StreamedLayer:
    tier: str
    image: LayerImage
    templates: dict[str, LinearWeight]
    host_data: torch.Tensor | None = None  # host tier: the image
    file: OpenFile | None = None  # disk tier


@dataclass(frozen=True)
class StreamLayout:
    """What a store of streamed weights needs of a placement: each layer's tier, how many
    accelerator buffers the ring has, and the bytes of one (the planner's estimate, reserved
    against the weight budget while layers are built; the ring itself is sized from the images)."""

    tiers: tuple[str, ...]
    num_buffers: int
    buffer_bytes: int

    @classmethod
    def of(cls, placement: WeightPlacement) -> "StreamLayout":
        return cls(tuple(placement.tiers), placement.num_buffers, placement.layer_bytes)

    def num_layers_in(self, tier: str) -> int:
        return sum(t == tier for t in self.tiers)


@dataclass
class StreamStats:
    """Running totals since start (seconds, bytes); the engine reports per-iteration deltas."""

    bytes_by_tier: dict[str, int] = field(default_factory=lambda: {TIER_HOST: 0, TIER_DISK: 0})
    transfer_s: float = 0.0  # loads in progress, summed
    stall_s: float = 0.0  # acquires waiting on a load
    num_loads: int = 0

    def snapshot(self) -> "StreamStats":
        return StreamStats(dict(self.bytes_by_tier), self.transfer_s, self.stall_s, self.num_loads)


class StreamedLayers(LayerStore):
    weights_stay_put = False  # streamed layers' weights are rebound to ring buffers as they come

    def __init__(self, layout: StreamLayout, device: torch.device, copy_engine: CopyEngine,
                 files: LayerFiles | None = None, reader: DirectReader | None = None,
                 accelerator_weight_budget_bytes: int | None = None, global_weight_bytes: int = 0) -> None:
        super().__init__(device)
        if layout.num_layers_in(TIER_DISK) and (files is None or reader is None):
            raise ValueError("disk-placed layers need the offload directory's files and a reader")
        self.layout = layout
        self.copy_engine = copy_engine
        self.files = files
        self.reader = reader
        self.budget_bytes = accelerator_weight_budget_bytes
        self.used_bytes = global_weight_bytes  # embeddings, LM head, norms: resident always
        self.tiers = list(layout.tiers)
        # layers with streamed weights -> what streams (the whole layer, or a sliced MLP's CG part)
        self._streamed: dict[int, _StreamedLayer] = {}
        self._bindings: dict[int, _Binding] = {}
        self.stats = StreamStats()
        self._buffers: list[_Buffer] = []
        self._staging: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self._order: list[int] = []  # streamed layers in forward order
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_use = 0  # uses (acquires) of streamed layers so far
        self._next_release = 0
        self._warned_buffered_reads = False

    # ---- building ---------------------------------------------------------------------------
    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        """Every layer becomes an image built on the host: a resident one is copied into an
        accelerator buffer of its own and bound there (so resident and streamed layers compute
        from the same kind of memory), a streamed one stays in host memory or goes to its file."""
        built = build_host_layer(None, index, linear, dtype, self.device, self.copy_engine.allocate_host, loaded)
        host, image = built.weights, built.image
        templates = meta_templates({name: getattr(host, name) for name in LINEAR_NAMES})
        norms = dict(input_norm=host.input_norm.to(self.device), post_norm=host.post_norm.to(self.device))
        if self.tiers[index] == TIER_ACCELERATOR:
            if self._fits(image.nbytes):
                return LayerWeights(**norms, **self.place_resident(image, templates, built.data))
            logger.info("layer %d: %.1f MiB more than the planner counted leave no room on the accelerator; "
                        "streamed from host memory instead", index, image.nbytes / 2**20)
            self.tiers[index] = TIER_HOST
        return LayerWeights(**norms, **self.place_streamed(index, self.tiers[index], image, templates, built.data))

    def place_resident(self, image: LayerImage, templates: dict[str, LinearWeight],
                  data: torch.Tensor) -> dict[str, LinearWeight]:
        """Weights copied from their host image into an accelerator buffer of their own, bound there."""
        self.used_bytes += image.nbytes
        buffer = self.copy_engine.allocate_buffer(image.nbytes)
        self.copy_engine.copy(buffer, data)
        return image.bind(templates, buffer)

    def place_streamed(self, index: int, tier: str, image: LayerImage, templates: dict[str, LinearWeight],
                data: torch.Tensor) -> dict[str, LinearWeight]:
        """Layer `index`'s weights in `image` (host bytes `data`) streamed from `tier` each time the
        layer is acquired: the StreamedWeights that apply them, by name."""
        layer = _StreamedLayer(tier, image, templates)
        if tier == TIER_HOST:
            layer.host_data = data
        else:
            layer.file = self._store_on_disk(index, image, data)
        self._streamed[index] = layer
        binding = self._bindings[index] = _Binding(index)
        return {name: StreamedWeight(binding, name, template, tier) for name, template in templates.items()}

    def _fits(self, nbytes: int) -> bool:
        if self.budget_bytes is None:
            return True
        reserved = self.layout.num_buffers * self.layout.buffer_bytes  # the ring, allocated at start
        return self.used_bytes + nbytes + reserved <= self.budget_bytes

    def _store_on_disk(self, index: int, image: LayerImage, data: torch.Tensor) -> OpenFile:
        if not self.files.has_layer(index, image):
            self.files.write_layer(index, image, data)
        file = self.files.open(index)
        if not file.direct and not self._warned_buffered_reads:
            logger.warning("disk-placed layers: %s", file.reason)
            self._warned_buffered_reads = True
        return file

    def start(self) -> None:
        """Allocate the ring (and disk staging) for the largest streamed image; start loading."""
        self.copy_engine.synchronize()  # resident layers' copies
        self._order = sorted(self._streamed)
        if not self._order:
            return
        buffer_bytes = max(self._streamed[i].image.nbytes for i in self._order)
        num_buffers = max(1, min(self.layout.num_buffers, len(self._order)))
        total = self.used_bytes + num_buffers * buffer_bytes
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise ConfigError(f"weights on the accelerator take {total / 2**30:.2f} GiB ({num_buffers} layer buffers "
                              f"of {buffer_bytes / 2**20:.1f} MiB included), more than --weights-gpu-gib gives "
                              f"({self.budget_bytes / 2**30:.2f} GiB); give more")
        self._buffers = [_Buffer(self.copy_engine.allocate_buffer(buffer_bytes)) for _ in range(num_buffers)]
        if any(self._streamed[i].tier == TIER_DISK for i in self._order):
            self._staging = [(self.copy_engine.allocate_host(buffer_bytes).zero_(), {})
                             for _ in range(NUM_STAGING_BUFFERS)]
        self._restart()

    def transfer_stats(self) -> StreamStats | None:
        return self.stats.snapshot() if self._order else None

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        nbytes = sum(b.data.numel() for b in self._buffers)
        return {(BUFFER_FORMAT, TIER_ACCELERATOR): nbytes} if nbytes else {}

    # ---- the compute side (the accelerator's thread) ---------------------------------------------
    def acquire(self, layer: int) -> None:
        if layer not in self._streamed:
            return
        expected = self._order[self._next_use % len(self._order)]
        if layer != expected:
            raise RuntimeError(f"streamed layers are used in order: expected layer {expected}, got {layer}")
        buffer = self._buffers[self._next_use % len(self._buffers)]
        start = time.perf_counter()
        while not buffer.ready.wait(WAIT_POLL_S):
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the weight transfer thread has stopped")
        self.stats.stall_s += time.perf_counter() - start
        if buffer.error is not None:
            raise RuntimeError(f"loading layer {layer}'s weights failed: {buffer.error}") from buffer.error
        self.copy_engine.wait_loaded(buffer.engine_state)
        self._bindings[layer].current = buffer.weights
        self._next_use += 1

    def release(self, layer: int) -> None:
        if layer not in self._streamed:
            return
        buffer = self._buffers[self._next_release % len(self._buffers)]
        if buffer.layer != layer or self._next_release >= self._next_use:
            raise RuntimeError(f"layer {layer} released out of order")
        self._bindings[layer].current = None
        buffer.ready.clear()
        self.copy_engine.on_release(buffer.engine_state)
        buffer.free.set()
        self._next_release += 1

    def recover(self) -> None:
        """Stop the loads, forget what was acquired, and start the cycle again at its first layer."""
        if self._order:
            self._stop()
            self._restart()

    def close(self) -> None:
        self._stop()
        for layer in self._streamed.values():
            if layer.file is not None:
                os.close(layer.file.fd)
                layer.file = None
        self.copy_engine.close()
        if self.reader is not None:
            self.reader.close()

    # ---- the transfer side ---------------------------------------------------------------------
    def _restart(self) -> None:
        self._next_use = self._next_release = 0
        for binding in self._bindings.values():
            binding.current = None
        for buffer in self._buffers:
            buffer.ready.clear()
            buffer.layer, buffer.weights, buffer.error = None, None, None
            buffer.free.set()
        self._stopping = False
        self._thread = threading.Thread(target=self._load_forever, name="tandem-weight-transfer", daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        for buffer in self._buffers:
            buffer.free.set()  # wakes a transfer thread waiting for a buffer
        self._thread.join()
        self._thread = None

    def _load_forever(self) -> None:
        self._init_thread()
        load = 0
        while True:
            buffer = self._buffers[load % len(self._buffers)]
            buffer.free.wait()
            if self._stopping:
                return
            buffer.free.clear()
            layer = self._order[load % len(self._order)]
            try:
                self._load(layer, buffer, load)
            except BaseException as exc:  # handed to the acquire that waits for this layer
                buffer.error = exc
                logger.exception("loading layer %d's weights failed", layer)
            buffer.layer = layer
            buffer.ready.set()
            load += 1

    def _init_thread(self) -> None:
        """The transfer thread copies with one torch thread, on the host-side cores (testbed)."""
        torch.set_num_threads(1)
        cores = self.copy_engine.cores
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)

    def _load(self, index: int, buffer: _Buffer, load: int) -> None:
        layer = self._streamed[index]
        nbytes = layer.image.nbytes
        start = time.perf_counter()
        self.copy_engine.before_load(buffer.engine_state)
        target = buffer.data[:nbytes]
        if layer.tier == TIER_HOST:
            self.copy_engine.copy(target, layer.host_data[:nbytes])
        else:
            staging, staging_state = self._staging[load % len(self._staging)]
            self.copy_engine.wait_source_free(staging_state)
            self.reader.read(layer.file, 0, nbytes, staging,
                             on_block=lambda a, b: self.copy_engine.copy(target[a:b], staging[a:b]))
        self.copy_engine.after_load(buffer.engine_state)
        if layer.tier == TIER_DISK:
            staging_state["loaded"] = buffer.engine_state.get("loaded")
        buffer.weights = layer.image.bind(layer.templates, buffer.data)
        self.stats.transfer_s += time.perf_counter() - start
        self.stats.bytes_by_tier[layer.tier] += nbytes
        self.stats.num_loads += 1


def create_layer_store(placement: WeightPlacement, device: torch.device, cores: CoreAssignment,
                       files: LayerFiles | None, num_io_threads: int,
                       accelerator_weight_budget_bytes: int | None, global_weight_bytes: int) -> StreamedLayers:
    """The store for `placement` on `device`."""
    layout = StreamLayout.of(placement)
    engine, reader = create_transfer(layout, device, cores, num_io_threads)
    return StreamedLayers(layout, device, engine, files, reader, accelerator_weight_budget_bytes, global_weight_bytes)


def create_transfer(layout: StreamLayout, device: torch.device, cores: CoreAssignment,
                    num_io_threads: int) -> tuple[CopyEngine, DirectReader | None]:
    """The copy engine and (with disk-placed layers) the disk reader a store streams with:
    transfer threads on the host-side cores (all of them where the accelerator has none of its
    own), disk reads `num_io_threads` at a time."""
    host_cores = cores.cpu_attention_cores or None
    engine = create_copy_engine(device, len(cores.cpu_attention_cores) or 1, host_cores)
    reader = None
    if layout.num_layers_in(TIER_DISK):
        reader = DirectReader(num_io_threads, initializer=pin_to(host_cores))
    return engine, reader
