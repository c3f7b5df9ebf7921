"""Quick measurements the weight planner needs (PIPO sec. 3.5: placement from *measured*
bandwidths): host -> GPU copies, O_DIRECT disk reads, and the GPU's time for one
layer's linear work, its decode attention and its head. A second or two in all, run by
`tandem plan` and by `tandem serve` before any weight is loaded.

Each runs the way the engine does the real thing: copies through the engine's copy engine on a
transfer thread kept to the host-side cores, reads through the same O_DIRECT reader, layer work
through the GPU's queue, on random weights of the model's shape and format (several
layers' worth, so the caches are cold as in a forward).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from engine.attention import create_decode_backend
from engine.device.queues import GpuQueue, InlineQueue
from engine.offload.transfer import CopyEngine, pin_to
from engine.model_config import ModelConfig
from engine.model.llama import LlamaModel
from engine.model.layer_weights import LayerWeights
from engine.profiling.profiler import median_seconds
from engine.quant import create_linear_method
from engine.weights.base import WeightLoader, global_shapes, layer_shapes
from engine.weights.direct_io import IO_ALIGN_BYTES, DirectReader, aligned_empty, open_for_reading
from engine.weights.file_writes import TMP_SUFFIX, free_bytes
from engine.weights.layer_files import LAYER_FILE_PATTERN, write_file
from engine.weights.layer_image import LayerImage
from scheduler.planning.cost_model import Curve, kv_bytes_per_token
from scheduler.planning import ComputeCosts

logger = logging.getLogger(__name__)

PROBE_BYTES = 256 * 2**20  # per copy and per disk read: well past any cache
# layers timed back to back: 4x the development host's 32 MiB L3, so the weights come from memory
COLD_WEIGHT_BYTES = 128 * 2**20
REPETITIONS = 3
# The planner estimates decode forwards: a batch of up to max_num_seqs (64 by default) rows,
# extrapolated linearly past the last point.
LINEAR_TOKENS = (1, 8, 32, 64)
DECODE_PROBE_TOKENS = 8  # the linear stage run beside the copies timed under compute: a decode batch
HEAD_ROWS = (1, 8, 32, 64)
WEIGHT_STD = 0.02


def _median_s(run: Callable[[], Any], repetitions: int = REPETITIONS) -> float:
    """After one warm-up run (page faults, lazy initialisation)."""
    return median_seconds(run, warmup=1, repetitions=repetitions)


def _on_thread(fn: Callable[[], Any], initialize: Callable[[], None]) -> Any:
    """fn() on a fresh thread set up by `initialize` (as the engine's transfer thread is)."""
    result: dict[str, Any] = {}

    def run() -> None:
        initialize()
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised on the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="tandem-probe")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_link_bytes_per_s(engine: CopyEngine, nbytes: int = PROBE_BYTES) -> float:
    """Host buffer -> GPU layer buffer through `engine`, from a transfer thread."""
    return nbytes / measure_copy_s(engine, nbytes)


def measure_copy_s(engine: CopyEngine, nbytes: int, source_bytes: int = 0) -> float:
    """One copy of `nbytes` from a host buffer into a GPU buffer through `engine`, from a
    transfer thread, until it has landed. With `source_bytes` beyond `nbytes`, each copy reads the
    next part of a source that large, so small copies come from memory as a layer's would, not
    from the cache the previous copy filled."""
    source = engine.allocate_host(max(nbytes, source_bytes)).fill_(1)
    target = engine.allocate_buffer(nbytes)
    starts = itertools.cycle(range(0, source.numel() - nbytes + 1, nbytes))

    def copy() -> None:
        start = next(starts)
        engine.copy(target, source[start:start + nbytes])
        _synchronize(engine.device)
    return _on_thread(lambda: _median_s(copy), pin_to(engine.cores))


def measure_disk_bytes_per_s(directory: str | os.PathLike[str], reader: DirectReader,
                             nbytes: int = PROBE_BYTES) -> tuple[float, bool]:
    """O_DIRECT reads in `directory`: of the layer files already there (what the engine will read),
    else of a probe file written for the purpose (removed after; on a VM a file just written may
    still sit in the host's cache, and read faster than the disk). -> bytes per second, and
    whether the reads bypassed the page cache."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    existing = sorted(directory.glob(LAYER_FILE_PATTERN))
    if existing:
        return _read_rate(_enough(existing, nbytes), reader)
    path = directory / ".tandem-disk-probe"
    path.with_name(path.name + TMP_SUFFIX).unlink(missing_ok=True)  # left by a killed run
    nbytes = _probe_bytes(directory, nbytes)
    buffer = aligned_empty(nbytes)
    buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # incompressible
    write_file(path, buffer)
    try:
        return _read_rate([path], reader)
    finally:
        path.unlink(missing_ok=True)


def _probe_bytes(directory: Path, nbytes: int) -> int:
    """The probe file's size: `nbytes`, or half the filesystem's free space where that is less (a
    less exact rate, but the layer files' own space check, not the probe, says what is missing)."""
    room = free_bytes(directory) // 2 // IO_ALIGN_BYTES * IO_ALIGN_BYTES
    if room >= nbytes:
        return nbytes
    logger.info("disk probe: %.1f MiB, half the free space of %s, not %.0f MiB; the measured rate may be less exact",
                room / 2**20, directory, nbytes / 2**20)
    return max(room, IO_ALIGN_BYTES)


def _enough(paths: list[Path], nbytes: int) -> list[Path]:
    """The first files holding at least `nbytes` together (all of them if they hold less)."""
    chosen, total = [], 0
    for path in paths:
        chosen.append(path)
        total += path.stat().st_size
        if total >= nbytes:
            break
    return chosen


def _read_rate(paths: list[Path], reader: DirectReader) -> tuple[float, bool]:
    sizes = [path.stat().st_size // IO_ALIGN_BYTES * IO_ALIGN_BYTES for path in paths]
    buffer = aligned_empty(max(sizes)).zero_()
    files = [open_for_reading(path) for path in paths]
    try:
        def read_all() -> None:
            for file, size in zip(files, sizes):
                reader.read(file, 0, size, buffer)
        seconds = _median_s(read_all, repetitions=2)
    finally:
        for file in files:
            os.close(file.fd)
    return sum(sizes) / seconds, all(file.direct for file in files)


class _RandomLoader(WeightLoader):
    """Random weights in the model's shape (as the dummy loader's, without a preset)."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.source = f"probe:{config.name}"
        self.tokenizer_source = None
        self.generator = torch.Generator().manual_seed(0)

    def _tensors(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {key: torch.ones(shape, dtype=dtype) if key.endswith("norm")
                else (torch.randn(shape, generator=self.generator) * WEIGHT_STD).to(dtype)
                for key, shape in shapes.items()}

    def load_globals(self, dtype):
        return self._tensors(global_shapes(self.config), dtype)

    def load_layer(self, index, dtype):
        return self._tensors(layer_shapes(self.config, index), dtype)


class _Repeating:
    """Runs `fn` over and over on a thread set up by `initialize` (or through `submit`, on the
    GPU's queue) until stopped: the other side's load while one side is timed."""

    def __init__(self, fn: Callable[[], Any], initialize: Callable[[], None] | None = None,
                 gpu: GpuQueue | None = None) -> None:
        self._stop = threading.Event()
        self._started = threading.Event()

        def loop() -> None:
            if initialize is not None:
                initialize()
            self._started.set()
            while not self._stop.is_set():
                fn()
        if gpu is not None and not isinstance(gpu, InlineQueue):
            self._done = gpu.submit(loop)  # on the GPU's own thread (and cores)
        else:  # device cpu: the GPU's work runs on the caller, which is busy timing
            self._thread = threading.Thread(target=loop, name="tandem-probe-load", daemon=True)
            self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        self._stop.set()
        if hasattr(self, "_thread"):
            self._thread.join()
        else:
            self._done.result()


def measure_compute(config: ModelConfig, dtype: torch.dtype, linear_method: str, gpu: GpuQueue,
                    layer_bytes: int, engine: CopyEngine) -> tuple[ComputeCosts, float]:
    """One layer's linear work by tokens (layers back to back, cold), alone and while the copy
    engine copies beside it; decode attention per context token (the GPU's read bandwidth
    over one token's K/V); the head by rows. Also the copy engine's rate while a decode-sized
    linear stage runs: on the host-only testbed both share one memory bus and slow each other (on
    a GPU they should not). -> (the costs, bytes/s of host -> GPU copies under compute)"""
    num_layers = max(1, min(config.num_layers, -(-COLD_WEIGHT_BYTES // layer_bytes)))
    small = dataclasses.replace(config, num_layers=num_layers)
    device = gpu.device
    model = gpu.submit(lambda: LlamaModel(
        small, _RandomLoader(small), dtype, device, 64, create_decode_backend("auto", str(device)),
        linear_method=create_linear_method(linear_method))).result()
    for index, layer in enumerate(model.layers):  # in the copy engine's buffers, as a placed model's layers are
        linears = layer.named_linears()
        image = LayerImage.of(linears)
        buffer = engine.allocate_buffer(image.nbytes)
        image.write(linears, buffer)
        model.layers[index] = LayerWeights.of_linears(layer.input_norm, layer.post_norm, image.bind(linears, buffer))

    def timed(work: Callable[[], Any]) -> float:
        return _median_s(lambda: gpu.submit(lambda: (work(), _synchronize(device))).result())

    def layers_of(num_tokens: int) -> Callable[[], None]:
        hidden = torch.randn(num_tokens, config.hidden_size, dtype=dtype, device=device)
        attn_out = torch.randn(num_tokens, config.q_size, dtype=dtype, device=device)
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)

        def layers() -> None:
            for layer in range(num_layers):
                model.pre_proj(layer, hidden, positions)
                model.post_proj(layer, hidden, attn_out)
        return layers

    linear = [(n, timed(layers_of(n)) / num_layers) for n in LINEAR_TOKENS]
    source, target = engine.allocate_host(PROBE_BYTES).fill_(1), engine.allocate_buffer(PROBE_BYTES)
    copying = _Repeating(lambda: (engine.copy(target, source), _synchronize(engine.device)), pin_to(engine.cores))
    try:
        linear_busy = [(n, timed(layers_of(n)) / num_layers) for n in LINEAR_TOKENS]
    finally:
        copying.stop()
    computing = _Repeating(layers_of(DECODE_PROBE_TOKENS), gpu=gpu)
    try:
        link_busy = PROBE_BYTES / _on_thread(lambda: _median_s(lambda: (engine.copy(target, source),
                                                                        _synchronize(engine.device))),
                                             pin_to(engine.cores))
    finally:
        computing.stop()
    head = []
    for num_rows in HEAD_ROWS:
        token_ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
        rows = torch.arange(num_rows, device=device)
        head.append((num_rows, timed(lambda: model.post_layer(model.pre_layer(token_ids), rows))))
    scratch = torch.ones(PROBE_BYTES // dtype.itemsize, dtype=dtype, device=device)
    read_bytes_per_s = PROBE_BYTES / timed(lambda: scratch.sum())
    token_bytes = kv_bytes_per_token(1, config.num_kv_heads, config.head_dim, dtype.itemsize)
    costs = ComputeCosts(Curve.from_points(linear), token_bytes / read_bytes_per_s, Curve.from_points(head),
                         linear_under_transfer=Curve.from_points(linear_busy))
    return costs, link_busy
