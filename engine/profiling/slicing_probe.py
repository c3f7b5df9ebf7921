"""The points ScheInfer's linear models are fitted to (sec. IV-A1; the paper's Table lists a, b and
R^2 per kind): GEMMs on the CPU and on the accelerator, host -> accelerator copies, and one
launch, measured the way slicing runs them, a few seconds in all.

- GEMMs go through the engine's own weight objects (engine/quant: dense, or INT4 with the
  kernels/cpu kernels) in the configured format, on slices of the model's MLP weights (gate/up
  rows, down columns) at a few token counts: on the engine thread kept to the CPU's cores for CC,
  and on the accelerator's queue for CG and GG, timed on the accelerator's side so a launch is
  not counted twice. Several copies of a small slice are run in turn, so its weights come from
  memory as in a forward, not from the cache.
- Copies go through the engine's copy engine (streaming_probe.measure_copy_s), from a quarter
  of a MiB to one MLP's bytes (16 MiB at least).
- A launch is the time per queued tiny kernel when many are queued: the cost on the issuing
  side that the accelerator waits for when its queue is otherwise empty.
- Each side's whole-MLP GEMMs are timed again while the other side runs a GEMM loop: on the
  host-only testbed the two "devices" are vCPUs sharing a physical core and a memory bus, and a
  sliced MLP (CC beside GG) ran slower than either side alone; on a GPU the factors come out near 1.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Callable

import torch

from engine.execution.cores import CoreAssignment
from engine.execution.queues import AcceleratorQueue
from engine.execution.transfer import CopyEngine, pin_to
from engine.model import ModelConfig
from engine.profiling.streaming_probe import (
    COLD_WEIGHT_BYTES,
    PROBE_BYTES,
    WEIGHT_STD,
    _median_s,
    _Repeating,
    measure_copy_s,
)
from engine.quant import LinearWeight, create_linear_method
from scheduler.placement.slicing_cost import UNIT_BYTES, SlicingCosts, fit_gemm_cost, fit_linear_cost

GEMM_TOKENS = (1, 4, 16, 64)
UNIT_FRACTIONS = (0.25, 1.0)  # of the MLP's intermediate units: a slice, and the whole weight
UNIT_ALIGN = 64  # slices keep whole INT4 groups and tiles
MAX_COPIES = 256  # of a small slice, so that together they spill the caches (COLD_WEIGHT_BYTES)
MIN_COPY_BYTES = 256 * 2**10
# copies of these fractions of one MLP's bytes (of this much for a smaller MLP, so the sizes differ)
COPY_FRACTIONS = (1 / 64, 1 / 8, 1 / 2, 1.0)
MIN_COPY_SPAN_BYTES = 16 * 2**20
NUM_LAUNCHES = 200

logger = logging.getLogger(__name__)


def _slice_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of the gate/up and down slices measured."""
    shapes = []
    for fraction in UNIT_FRACTIONS:
        units = max(UNIT_ALIGN, round(fraction * config.intermediate_size / UNIT_ALIGN) * UNIT_ALIGN)
        shapes += [(2 * units, config.hidden_size), (config.hidden_size, units)]
    return shapes


def _weights(shape: tuple[int, int], method: str, dtype: torch.dtype, device: torch.device) -> list[LinearWeight]:
    """Copies of one random weight in the engine's format, enough to spill the caches."""
    dense = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * WEIGHT_STD
    linear_method = create_linear_method(method)
    first = linear_method.create_weight(dense, None, dtype=dtype, device=device)
    num_copies = max(1, min(MAX_COPIES, math.ceil(COLD_WEIGHT_BYTES / first.nbytes)))
    return [first] + [linear_method.create_weight(dense, None, dtype=dtype, device=device)
                      for _ in range(num_copies - 1)]


def _gemm_points(shapes: list[tuple[int, int]], method: str, dtype: torch.dtype, device: torch.device,
                 timed: Callable[[Callable[[], object]], float],
                 on_device: Callable[[Callable[[], object]], object]) -> list[tuple[float, float, float]]:
    """(multiply-adds, weight bytes, seconds) of every slice at every token count; weights are made
    and timed where `on_device` runs work, `timed` gives one run's seconds."""
    points = []
    for out_features, in_features in shapes:
        weights = on_device(lambda: _weights((out_features, in_features), method, dtype, device))
        for num_tokens in GEMM_TOKENS:
            x = on_device(lambda: torch.randn(num_tokens, in_features, dtype=dtype, device=device))
            seconds = timed(lambda: [weight.apply(x) for weight in weights]) / len(weights)
            points.append((float(num_tokens * out_features * in_features), float(weights[0].nbytes), seconds))
    return points


def _slowdown(alone: list[tuple[float, float, float]], busy: list[tuple[float, float, float]]) -> float:
    """How many times longer the same GEMMs took beside the other side's work (at least 1: a
    faster run beside a load is noise)."""
    return max(1.0, statistics.median(b[-1] / a[-1] for a, b in zip(alone, busy)))


def _gemm_load(method: str, dtype: torch.dtype, device: torch.device, shape: tuple[int, int]) -> Callable[[], None]:
    """A GEMM to run over and over as the other side's load: a whole MLP weight at a decode batch."""
    weight = create_linear_method(method).create_weight(torch.randn(shape) * WEIGHT_STD, None, dtype=dtype,
                                                        device=device)
    x = torch.randn(GEMM_TOKENS[-1], shape[1], dtype=dtype, device=device)
    return _synchronized(device, lambda: weight.apply(x))
def _synchronized(device: torch.device, run: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return call


def _launch_s(accelerator: AcceleratorQueue) -> float:
    device = accelerator.device
    counter = accelerator.submit(lambda: torch.zeros(1, device=device)).result()

    def launches() -> None:
        futures = [accelerator.submit(lambda: counter.add_(1)) for _ in range(NUM_LAUNCHES)]
        futures[-1].result()
    return _median_s(launches) / NUM_LAUNCHES


def measure_slicing_costs(config: ModelConfig, dtype: torch.dtype, linear_method: str, accelerator: AcceleratorQueue,
                          engine: CopyEngine, cores: CoreAssignment) -> SlicingCosts:
    """The four models for weights made by `linear_method` in `dtype`, fitted to this machine,
    and how much each side's GEMMs slow while the other side computes (the whole MLP's slices
    again, beside a GEMM loop on the other side)."""
    start = time.perf_counter()
    device, cpu_device = accelerator.device, torch.device("cpu")
    shapes = _slice_shapes(config)
    whole = shapes[-2:]  # the last fraction is the whole MLP: its gate/up and down

    def on_cpu(run_shapes: list[tuple[int, int]]) -> list[tuple[float, float, float]]:
        with cores.on_cpu_cores(), torch.inference_mode():
            return _gemm_points(run_shapes, linear_method, dtype, cpu_device, _median_s, lambda make: make())

    def on_accelerator(run_shapes: list[tuple[int, int]]) -> list[tuple[float, float, float]]:
        return _gemm_points(run_shapes, linear_method, dtype, device,
                            lambda run: accelerator.submit(lambda: _median_s(_synchronized(device, run))).result(),
                            lambda make: accelerator.submit(make).result())
    cpu, accelerator_points = on_cpu(shapes), on_accelerator(shapes)
    accelerator_load = _Repeating(accelerator.submit(lambda: _gemm_load(linear_method, dtype, device, whole[0])).result(),
                                  accelerator=accelerator)
    try:
        cpu_busy = on_cpu(whole)
    finally:
        accelerator_load.stop()
    cpu_load = _Repeating(_gemm_load(linear_method, dtype, cpu_device, whole[0]), pin_to(cores.cpu_attention_cores or None))
    try:
        accelerator_busy = on_accelerator(whole)
    finally:
        cpu_load.stop()
    span = max(MIN_COPY_SPAN_BYTES, 3 * config.hidden_size * config.intermediate_size * dtype.itemsize)
    sizes = sorted({min(PROBE_BYTES, max(MIN_COPY_BYTES, round(f * span))) for f in COPY_FRACTIONS})
    link = [(float(size), measure_copy_s(engine, size, COLD_WEIGHT_BYTES)) for size in sizes]
    costs = SlicingCosts(fit_gemm_cost(accelerator_points), fit_gemm_cost(cpu), fit_linear_cost(link, UNIT_BYTES),
                         _launch_s(accelerator), cpu_gemm_slowdown=_slowdown(cpu[-len(cpu_busy):], cpu_busy),
                         accelerator_gemm_slowdown=_slowdown(accelerator_points[-len(accelerator_busy):],
                                                             accelerator_busy))
    logger.info("MLP slicing models measured in %.1f s: %s", time.perf_counter() - start, costs.to_dict())
    return costs
