"""PIPO's weight-streaming pipeline (sec. 3.1-3.3, Alg. 1): weights kept in host memory or on disk
are loaded into a ring of preallocated GPU buffers while earlier layers compute. Whole
streamed layers (PIPO) and sliced MLPs' CG parts (ScheInfer) pass through the same ring.

Each streamed item is one layer image (engine/weights/layer_image.py) of one decoder layer, in a
host buffer (pinned on CUDA) or in its file in the offload directory; its linear weights are
`StreamedWeight`s, which apply whatever weights the layer's current buffer holds.

One transfer thread (PIPO's thread pool runs one weight load at a time) loads the items in the
order forwards use them, round and round across forwards: load j goes into buffer j % num_buffers
once the layer that used it was released. A host item is one multi-threaded copy; a disk item is
read block by block with O_DIRECT by several threads into an aligned host staging buffer, each
block copied on as it lands. `acquire` waits for the layer's load (the pipeline's stall,
measured), `release` frees its buffer for the next load. Nothing is allocated while serving but
the tensor views a load binds.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.offload.stats import WeightStats
from engine.offload.transfer import CopyEngine
from engine.quant import LinearWeight
from engine.quant.base import WrappedWeight
from engine.weights.direct_io import DirectReader, OpenFile
from engine.weights.layer_files import LayerFiles
from engine.weights.layer_image import LayerImage
from scheduler.planning.tiers import Tier

logger = logging.getLogger(__name__)

BUFFER_FORMAT = "layer buffers"  # weight_bytes' format label for the ring's buffers
# How often a waiting acquire checks that the transfer thread is still alive.
WAIT_POLL_S = 1.0
NUM_STAGING_BUFFERS = 2  # as scheduler.planning.placement.NUM_STAGING_BUFFERS plans them


class _Binding:
    """Which weights a streamed layer's StreamedWeights apply: its buffer's, while acquired."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.current: dict[str, LinearWeight] | None = None


class StreamedWeight(WrappedWeight):
    """A streamed item's linear weight: applies the weights bound from the buffer its layer was
    loaded into. Using it outside acquire/release is an error, never a silent stale read. Its
    inner weight is the template: kind and layout, tensors on the meta device."""

    method = "streamed"

    def __init__(self, binding: _Binding, name: str, template: LinearWeight, tier: Tier) -> None:
        super().__init__(template)
        self.binding = binding
        self.name = name
        self.tier = tier

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        current = self.binding.current
        if current is None:
            raise RuntimeError(f"layer {self.binding.layer}'s weights are not on the GPU: a forward must "
                               f"acquire a streamed layer before using it")
        return current[self.name].apply(x)

    def with_tensors(self, tensors):
        return self.inner.with_tensors(tensors)


@dataclass
class _Buffer:
    """One GPU buffer of the ring."""

    data: torch.Tensor  # uint8 [buffer bytes]
    free: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    layer: int | None = None
    weights: dict[str, LinearWeight] | None = None
    error: BaseException | None = None
    engine_state: dict[str, Any] = field(default_factory=dict)  # the copy engine's events


@dataclass
class StreamedItem:
    """What streams for one layer: the whole layer, or its MLP's CG part."""

    tier: Tier
    image: LayerImage
    templates: dict[str, LinearWeight]
    host_data: torch.Tensor | None = None  # host tier: the image
    file: OpenFile | None = None  # disk tier
    file_offset: int = 0  # where the image starts in its file, past the header


class BufferRing:
    """The ring, its transfer thread and the items it streams (at most one per layer)."""

    def __init__(self, copy_engine: CopyEngine, num_buffers: int, stats: WeightStats,
                 files: LayerFiles | None = None, reader: DirectReader | None = None) -> None:
        self.copy_engine = copy_engine
        self.num_buffers = num_buffers
        self.stats = stats
        self.files = files
        self.reader = reader
        self.items: dict[int, StreamedItem] = {}
        self._bindings: dict[int, _Binding] = {}
        self._buffers: list[_Buffer] = []
        self._staging: list[tuple[torch.Tensor, dict[str, Any]]] = []
        self._order: list[int] = []  # streamed layers in forward order
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_use = 0  # uses (acquires) of streamed layers so far
        self._next_release = 0
        self._warned_buffered_reads = False

    # ---- building ---------------------------------------------------------------------------
    def add(self, layer: int, tier: Tier, image: LayerImage, templates: dict[str, LinearWeight],
            data: torch.Tensor) -> dict[str, StreamedWeight]:
        """Stream layer `layer`'s weights in `image` (host bytes `data`) from `tier` each time the
        layer is acquired: the StreamedWeights that apply them, by name."""
        if tier == Tier.DISK and (self.files is None or self.reader is None):
            raise ValueError("disk-placed layers need the offload directory's files and a reader")
        item = StreamedItem(tier, image, templates)
        if tier == Tier.HOST:
            item.host_data = data
        else:
            item.file = self._store_on_disk(layer, image, data)
            item.file_offset = self.files.payload_offset(layer)
        self.items[layer] = item
        binding = self._bindings[layer] = _Binding(layer)
        return {name: StreamedWeight(binding, name, template, tier) for name, template in templates.items()}

    def _store_on_disk(self, layer: int, image: LayerImage, data: torch.Tensor) -> OpenFile:
        """The layer's file, written (again) from `data`, the image just built from the source
        weights, unless it holds that image intact already (LayerFiles.has_layer)."""
        if not self.files.has_layer(layer, image):
            self.files.write_layer(layer, image, data)
        file = self.files.open(layer)
        if not file.direct and not self._warned_buffered_reads:
            logger.warning("disk-placed layers: %s", file.reason)
            self._warned_buffered_reads = True
        return file

    def planned_bytes(self) -> int:
        """What `start` will allocate on the GPU: its buffers of the largest item."""
        if not self.items:
            return 0
        return min(self.num_buffers, len(self.items)) * max(item.image.nbytes for item in self.items.values())

    @property
    def allocated_bytes(self) -> int:
        return sum(buffer.data.numel() for buffer in self._buffers)

    def start(self) -> None:
        """Allocate the buffers (and disk staging) for the largest item; start loading."""
        self._order = sorted(self.items)
        if not self._order:
            return
        self.stats.streams = True
        buffer_bytes = max(self.items[i].image.nbytes for i in self._order)
        num_buffers = max(1, min(self.num_buffers, len(self._order)))
        self._buffers = [_Buffer(self.copy_engine.allocate_buffer(buffer_bytes)) for _ in range(num_buffers)]
        if any(self.items[i].tier == Tier.DISK for i in self._order):
            self._staging = [(self.copy_engine.allocate_host(buffer_bytes).zero_(), {})
                             for _ in range(NUM_STAGING_BUFFERS)]
        self._restart()

    # ---- the compute side (the GPU's thread) ---------------------------------------------
    def acquire(self, layer: int) -> None:
        if layer not in self.items:
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
        if layer not in self.items:
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
        for item in self.items.values():
            if item.file is not None:
                os.close(item.file.fd)
                item.file = None
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

    def _load(self, layer: int, buffer: _Buffer, load: int) -> None:
        item = self.items[layer]
        nbytes = item.image.nbytes
        start = time.perf_counter()
        self.copy_engine.before_load(buffer.engine_state)
        target = buffer.data[:nbytes]
        if item.tier == Tier.HOST:
            self.copy_engine.copy(target, item.host_data[:nbytes])
        else:
            staging, staging_state = self._staging[load % len(self._staging)]
            self.copy_engine.wait_source_free(staging_state)
            self.reader.read(item.file, item.file_offset, nbytes, staging,
                             on_block=lambda a, b: self.copy_engine.copy(target[a:b], staging[a:b]))
        self.copy_engine.after_load(buffer.engine_state)
        if item.tier == Tier.DISK:
            staging_state["loaded"] = buffer.engine_state.get("loaded")
        buffer.weights = item.image.bind(item.templates, buffer.data)
        self.stats.transfer_s += time.perf_counter() - start
        self.stats.bytes_by_tier[item.tier] += nbytes
        self.stats.num_loads += 1
