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
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from engine.execution.cores import CoreAssignment
from engine.execution.queues import AcceleratorQueue
from engine.execution.transfer import CopyEngine
from engine.model import ModelConfig
from engine.profiling.streaming_probe import COLD_WEIGHT_BYTES, PROBE_BYTES, WEIGHT_STD, _median_s, measure_copy_s
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


def _gemm_points(config: ModelConfig, method: str, dtype: torch.dtype, device: torch.device,
                 timed: Callable[[Callable[[], object]], float],
                 on_device: Callable[[Callable[[], object]], object]) -> list[tuple[float, float, float]]:
    """(multiply-adds, weight bytes, seconds) of every slice at every token count; weights are made
    and timed where `on_device` runs work, `timed` gives one run's seconds."""
    points = []
    for out_features, in_features in _slice_shapes(config):
        weights = on_device(lambda: _weights((out_features, in_features), method, dtype, device))
        for num_tokens in GEMM_TOKENS:
            x = on_device(lambda: torch.randn(num_tokens, in_features, dtype=dtype, device=device))
            seconds = timed(lambda: [weight.apply(x) for weight in weights]) / len(weights)
            points.append((float(num_tokens * out_features * in_features), float(weights[0].nbytes), seconds))
    return points


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
    """The four models for weights made by `linear_method` in `dtype`, fitted to this machine."""
    start = time.perf_counter()
    device = accelerator.device
    with cores.on_cpu_cores(), torch.inference_mode():
        cpu = _gemm_points(config, linear_method, dtype, torch.device("cpu"), lambda run: _median_s(run),
                           lambda make: make())
    accelerator_points = _gemm_points(
        config, linear_method, dtype, device,
        lambda run: accelerator.submit(lambda: _median_s(_synchronized(device, run))).result(),
        lambda make: accelerator.submit(make).result())
    span = max(MIN_COPY_SPAN_BYTES, 3 * config.hidden_size * config.intermediate_size * dtype.itemsize)
    sizes = sorted({min(PROBE_BYTES, max(MIN_COPY_BYTES, round(f * span))) for f in COPY_FRACTIONS})
    link = [(float(size), measure_copy_s(engine, size, COLD_WEIGHT_BYTES)) for size in sizes]
    costs = SlicingCosts(fit_gemm_cost(accelerator_points), fit_gemm_cost(cpu), fit_linear_cost(link, UNIT_BYTES),
                         _launch_s(accelerator))
    logger.info("MLP slicing models measured in %.1f s: %s", time.perf_counter() - start, costs.to_dict())
    return costs
