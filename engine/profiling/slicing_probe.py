"""The points ScheInfer's linear models are fitted to (sec. IV-A1; the paper's Table lists a, b and
R^2 per kind): GEMMs on the CPU and on the gpu, host -> GPU copies, and one
launch, measured the way slicing runs them, a few seconds in all.

- GEMMs go through the engine's own weight objects (engine/quant: dense, or INT4 with the
  kernels/cpu kernels) in the configured format, on slices of the model's MLP weights (gate/up
  rows, down columns; a MoE model's whole experts too) at a few token counts: on the engine
  thread kept to the CPU's cores for CC, and on the GPU's queue for CG and GG, timed on the GPU's side so a launch is
  not counted twice. Several copies of a small slice are run in turn, so its weights come from
  memory as in a forward, not from the cache.
- Copies go through the engine's copy engine (streaming_probe.measure_copy_s), from a quarter
  of a MiB to one MLP's bytes (16 MiB at least).
- A launch is the time per queued tiny kernel when many are queued: the cost on the issuing
  side that the GPU waits for when its queue is otherwise empty. A hand-over is the
  round trip of a trivial CPU part from the GPU's side (`run_on_host` and the hops).
- Each side's whole gate/up GEMM is timed at each token count alone and while the other side
  runs the same GEMM in a loop: on the host-only testbed the two "devices" are vCPUs sharing a
  memory bus, and a sliced MLP (CC beside GG) once ran slower than either side alone (on a GPU
  the factors should come out near 1). The largest copy is timed again beside a GPU
  GEMM loop, likewise. Where the copy engine is host threads (the testbed: `copies_on_cpu`), the
  GPU's GEMMs are also timed beside a copy loop, and the larger slowdown kept.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from typing import Callable, TypeVar

import torch

from engine.device.cores import CoreAssignment
from engine.device.queues import GpuQueue
from engine.offload.transfer import CopyEngine, pin_to
from engine.model_config import ModelConfig
from engine.profiling.streaming_probe import (
    COLD_WEIGHT_BYTES,
    PROBE_BYTES,
    WEIGHT_STD,
    _median_s,
    _Repeating,
    measure_copy_s,
)
from engine.quant import LinearWeight, create_linear_method
from scheduler.planning.slicing.cost import UNIT_BYTES, SlicingCosts, fit_gemm_cost, fit_linear_cost

GEMM_TOKENS = (1, 4, 16, 64)
UNIT_FRACTIONS = (0.25, 1.0)  # of the MLP's intermediate units: a slice, and the whole weight
UNIT_ALIGN = 64  # slices keep whole INT4 groups and tiles
MAX_COPIES = 256  # of a small slice, so that together they spill the caches (COLD_WEIGHT_BYTES)
MIN_COPY_BYTES = 256 * 2**10
# copies of these fractions of one MLP's bytes (of this much for a smaller MLP, so the sizes differ)
COPY_FRACTIONS = (1 / 64, 1 / 8, 1 / 2, 1.0)
MIN_COPY_SPAN_BYTES = 16 * 2**20
NUM_LAUNCHES = 200
NUM_HANDOFFS = 50

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _slice_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of the gate/up and down slices measured, the whole dense MLP's last; a MoE
    model's experts (its slicing unit) first."""
    shapes = []
    if config.moe is not None:
        units = config.moe.expert_intermediate_size
        shapes += [(2 * units, config.hidden_size), (config.hidden_size, units)]
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
    # deep copies, each with storage of its own (made again, an fp32 weight cast to fp32 was one shared,
    # warm tensor), and not quantized again (INT4's round-to-nearest of each copy took seconds)
    return [first] + [copy.deepcopy(first) for _ in range(num_copies - 1)]


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


def _slowdown(alone_and_beside_s: list[tuple[float, float]]) -> float:
    """How many times longer the same work took beside the other side's (the median over the
    pairs; at least 1: a faster run beside a load is noise)."""
    return max(1.0, statistics.median(beside / alone for alone, beside in alone_and_beside_s))


def _gemm_load(method: str, dtype: torch.dtype, device: torch.device,
               shape: tuple[int, int]) -> Callable[[int], Callable[[], None]]:
    """-> for a token count, work to run over and over as the other side's load: what slicing
    gives it, the same GEMM over copies of a weight that spill the caches (the two sides share a
    memory bus on the testbed, and at some batch sizes the same GEMM library)."""
    weights = _weights(shape, method, dtype, device)

    def at(num_tokens: int) -> Callable[[], None]:
        x = torch.randn(num_tokens, shape[1], dtype=dtype, device=device)
        return _synchronized(device, lambda: [weight.apply(x) for weight in weights])
    return at


def _synchronized(device: torch.device, run: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return call


def _copy_load(engine: CopyEngine, nbytes: int) -> Callable[[int], Callable[[], _Repeating]]:
    """-> (for any token count) copies of `nbytes` over and over on the copy engine's cores."""
    source = engine.allocate_host(nbytes).fill_(1)
    target = engine.allocate_buffer(nbytes)
    return lambda num_tokens: lambda: _Repeating(lambda: engine.copy(target, source), pin_to(engine.cores))


def _handoff_s(gpu: GpuQueue, hidden_size: int, dtype: torch.dtype) -> float:
    """A CPU part's fixed cost, as a sliced MLP pays it: from the GPU's side, one token's
    activations copied to the host, a trivial part run there (`run_on_host`) and its result
    taken back."""
    device = gpu.device
    x = gpu.submit(lambda: torch.zeros(1, hidden_size, dtype=dtype, device=device)).result()

    def handoff() -> None:
        on_host = gpu.copy_to_host(x)
        gpu.run_on_host(lambda: on_host.result() + 1).result().to(device)

    def handoffs() -> None:
        gpu.submit(lambda: [handoff() for _ in range(NUM_HANDOFFS)]).result()
    return _median_s(handoffs) / NUM_HANDOFFS


def _launch_s(gpu: GpuQueue) -> float:
    device = gpu.device
    counter = gpu.submit(lambda: torch.zeros(1, device=device)).result()

    def launches() -> None:
        futures = [gpu.submit(lambda: counter.add_(1)) for _ in range(NUM_LAUNCHES)]
        futures[-1].result()
    return _median_s(launches) / NUM_LAUNCHES


def _beside(start_load: Callable[[], _Repeating], measure: Callable[[], T]) -> T:
    """`measure()` while the load `start_load` starts runs."""
    load = start_load()
    try:
        return measure()
    finally:
        load.stop()


def measure_slicing_costs(config: ModelConfig, dtype: torch.dtype, linear_method: str, gpu: GpuQueue,
                          engine: CopyEngine, cores: CoreAssignment) -> SlicingCosts:
    """The four models for weights made by `linear_method` in `dtype`, fitted to this machine,
    and how much each side's GEMMs slow while the other side computes (the whole MLP's gate/up
    again, beside a GEMM loop on the other side)."""
    start = time.perf_counter()
    device, cpu_device = gpu.device, torch.device("cpu")
    shapes = _slice_shapes(config)
    whole = shapes[-2]  # the whole MLP's gate/up (the last fraction's first shape)

    def on_cpu(run: Callable[[], object]) -> float:
        with cores.on_cpu_cores(), torch.inference_mode():
            return _median_s(run)

    def on_gpu(run: Callable[[], object]) -> float:
        return gpu.submit(lambda: _median_s(_synchronized(device, run))).result()
    cpu = _gemm_points(shapes, linear_method, dtype, cpu_device, on_cpu, lambda make: make())
    gpu_points = _gemm_points(shapes, linear_method, dtype, device, on_gpu,
                                      lambda make: gpu.submit(make).result())
    # each side's whole gate/up at each token count, alone and beside the same on the other side
    cpu_work = _gemm_load(linear_method, dtype, cpu_device, whole)
    gpu_work = gpu.submit(lambda: _gemm_load(linear_method, dtype, device, whole)).result()

    def gpu_load(num_tokens: int) -> Callable[[], _Repeating]:
        return lambda: _Repeating(gpu.submit(lambda: gpu_work(num_tokens)).result(),
                                  gpu=gpu)

    def cpu_load(num_tokens: int) -> Callable[[], _Repeating]:
        return lambda: _Repeating(cpu_work(num_tokens), pin_to(cores.cpu_attention_cores or None))
    cpu_pairs = [(on_cpu(cpu_work(n)), _beside(gpu_load(n), lambda: on_cpu(cpu_work(n)))) for n in GEMM_TOKENS]

    def gpu_pairs(load: Callable[[int], Callable[[], _Repeating]]) -> list[tuple[float, float]]:
        return [(on_gpu(gpu_work(n)), _beside(load(n), lambda: on_gpu(gpu_work(n))))
                for n in GEMM_TOKENS]
    span = max(MIN_COPY_SPAN_BYTES, 3 * config.hidden_size * config.intermediate_size * dtype.itemsize)
    sizes = sorted({min(PROBE_BYTES, max(MIN_COPY_BYTES, round(f * span))) for f in COPY_FRACTIONS})
    gpu_slowdown = _slowdown(gpu_pairs(cpu_load))
    if engine.copies_on_host_cores:  # the testbed: the CPU side's cores also copy, beside the GPU
        gpu_slowdown = max(gpu_slowdown, _slowdown(gpu_pairs(_copy_load(engine, sizes[-1]))))
    link = [(float(size), measure_copy_s(engine, size, COLD_WEIGHT_BYTES)) for size in sizes]
    link_beside_s = _beside(gpu_load(1), lambda: measure_copy_s(engine, sizes[-1], COLD_WEIGHT_BYTES))
    costs = SlicingCosts(fit_gemm_cost(gpu_points), fit_gemm_cost(cpu), fit_linear_cost(link, UNIT_BYTES),
                         _launch_s(gpu), cpu_gemm_slowdown=_slowdown(cpu_pairs),
                         gpu_gemm_slowdown=gpu_slowdown,
                         link_slowdown=_slowdown([(link[-1][1], link_beside_s)]),
                         copies_on_cpu=engine.copies_on_host_cores,
                         handoff_s=_handoff_s(gpu, config.hidden_size, dtype))
    logger.info("MLP slicing models measured in %.1f s: %s", time.perf_counter() - start, costs.to_dict())
    return costs
