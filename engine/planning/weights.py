"""The engine's side of weight placement: an EngineConfig and this machine's measurements turned
into the planner's inputs (scheduler/planning), in one place for `tandem plan` and
`tandem serve`. Nothing here loads a weight."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from engine.config import GIB_BYTES, QUANTIZATION_METHODS, EngineConfig
from engine.device.cores import CoreAssignment
from engine.device.memory import default_gpu_memory_bytes
from engine.device.queues import GpuQueue, CudaStreamQueue, InlineQueue, WorkerThreadQueue
from engine.offload.transfer import create_copy_engine
from engine.kv import KVCache
from engine.kv.layouts import resolve_kv_format
from engine.model_config import ConfigError, ModelConfig
from engine.profiling.cache import ProfileKey, load_or_measure, profile_path
from engine.profiling.slicing_probe import measure_slicing_costs
from engine.profiling.streaming_probe import (
    DECODE_PROBE_TOKENS,
    measure_compute,
    measure_disk_bytes_per_s,
    measure_link_bytes_per_s,
)
from engine.weights.direct_io import DEFAULT_BLOCK_BYTES, DirectReader
from scheduler.planning.threads import DEFAULT_IO_THREADS
from engine.weights.layer_files import room_bytes
from scheduler.planning import (
    ComputeCosts,
    MemoryBudgets,
    ModelPlan,
    PlacementRequest,
    PlannerInputs,
    SlicingCosts,
    SlicingRequest,
    TransferRates,
    WeightFormat,
    Workload,
    layer_image_bytes,
)
from scheduler.planning import plan_model as plan_layers
from scheduler.planning.experts.hot_experts import DEFAULT_FETCH_BUFFERS, DEFAULT_SKEW, plan_expert_cache
from scheduler.planning.memory import resident_global_bytes
from scheduler.planning.model_plan import MOE_STREAMING_REFUSAL

logger = logging.getLogger(__name__)

# With no --weights-cpu-gib, host memory for streamed layers is this share of what the host has
# available, less the host KV pool.
HOST_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class Measurements:
    """What the planner needs measured on this machine."""

    rates: TransferRates
    costs: ComputeCosts
    disk_reads_direct: bool | None  # None: no offload directory, nothing read


def weight_format(config: EngineConfig, dtype: torch.dtype) -> WeightFormat:
    return WeightFormat(config.quantization, dtype.itemsize)


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budgets(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> MemoryBudgets:
    """The planner's budgets from the flags (GiB -> bytes), defaults filled in as the engine does."""
    cache, weights = config.cache, config.weights
    block_bytes = KVCache.bytes_per_block(model_config, cache.block_size,
                                          resolve_kv_format(cache.kv_cache_dtype, dtype))
    host_kv = cache.num_cpu_blocks_for(block_bytes) * block_bytes if config.cpu_attention_enabled else 0
    gpu_bytes = kv_bytes = None
    if cache.sized_by_memory_budget:
        gpu_bytes = int(cache.memory_gib * GIB_BYTES)
    elif cache.num_blocks is None and cache.kv_cache_memory_gib is None and config.device.startswith("cuda"):
        gpu_bytes = default_gpu_memory_bytes(config.torch_device)
    else:
        kv_bytes = cache.num_gpu_blocks_for(block_bytes) * block_bytes
    host = weights.host_gib
    host_bytes = (int(host * GIB_BYTES) if host is not None
                  else max(0, int(HOST_MEMORY_FRACTION * available_host_bytes()) - host_kv))
    disk_bytes = None
    if weights.offload_dir:
        os.makedirs(weights.offload_dir, exist_ok=True)  # serve writes its layer files there
        disk_bytes = room_bytes(weights.offload_dir)  # files already there are reused or replaced
    return MemoryBudgets(
        gpu_weight_bytes=None if weights.gpu_gib is None else int(weights.gpu_gib * GIB_BYTES),
        gpu_bytes=gpu_bytes, kv_cache_bytes=kv_bytes, host_weight_bytes=host_bytes,
        disk_bytes=disk_bytes, has_offload_dir=weights.offload_dir is not None, host_kv_cache_bytes=host_kv)


def workload(config: EngineConfig, max_model_len: int, dtype: torch.dtype | None = None,
             model_config: ModelConfig | None = None) -> Workload:
    """What the engine will run; `dtype` (the compute dtype) resolves an auto KV format. With
    `model_config`, a GPU pool of fixed size caps max_model_len where it is not given, as the engine
    caps it."""
    kv_bytes = None if dtype is None else resolve_kv_format(config.cache.kv_cache_dtype, dtype).element_bytes
    cache, speculative = config.cache, config.speculative_config
    pool_fixed = cache.num_blocks is not None or cache.kv_cache_memory_gib is not None or not (
        cache.sized_by_memory_budget or config.device.startswith("cuda"))
    if model_config is not None and dtype is not None and config.max_model_len is None and pool_fixed:
        block_bytes = KVCache.bytes_per_block(model_config, cache.block_size,
                                              resolve_kv_format(cache.kv_cache_dtype, dtype))
        max_model_len = min(max_model_len, cache.num_gpu_blocks_for(block_bytes) * cache.block_size)
    return Workload(max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                    max_num_batched_tokens=config.batched_tokens_budget,
                    block_size=config.cache.block_size,
                    context_len=min(config.weights.expected_context_len or max_model_len, max_model_len),
                    layers_in_use=2 if config.cpu_attention_enabled else 1, kv_element_bytes=kv_bytes,
                    num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0)


def _refuse_moe_streaming(model_config: ModelConfig) -> None:
    if model_config.is_moe:  # the probes and the layer images hold dense Llama layers
        raise ConfigError(f"{model_config.architecture}: {MOE_STREAMING_REFUSAL}")


def measure(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> Measurements:
    """Copy and disk rates and compute times on this machine, as the engine will run them (each
    measured once per process: every engine of a process runs on the same hardware)."""
    _refuse_moe_streaming(model_config)
    costs, link_busy = measure_compute_costs(config, model_config, dtype, config.quantization)
    rates, direct = measure_rates(config, link_busy)
    logger.info("measured: host->GPU %.2f GB/s (%.2f beside compute)%s; one layer's linear work at %d "
                "tokens %.1f ms (%.1f beside a copy)", rates.link_bytes_per_s / 1e9,
                rates.link_bytes_per_s_under_compute / 1e9,
                "" if rates.disk_bytes_per_s is None else
                f", disk {rates.disk_bytes_per_s / 1e9:.2f} GB/s ({'O_DIRECT' if direct else 'page cache'})",
                DECODE_PROBE_TOKENS, costs.linear(DECODE_PROBE_TOKENS) * 1e3,
                costs.linear_under_transfer(DECODE_PROBE_TOKENS) * 1e3)
    return Measurements(rates, costs, direct)


def measure_rates(config: EngineConfig, link_busy: float) -> tuple[TransferRates, bool | None]:
    """The link's rate alone and beside compute (`link_busy`, measured with the compute costs), and
    the offload directory's read rate (None without one), with whether its reads bypassed the page
    cache."""
    weights = config.weights
    cores = engine_cores(config)
    link = _link_bytes_per_s(config.torch_device, cores)
    io_threads = weights.num_io_threads or DEFAULT_IO_THREADS
    disk, direct = (None, None) if not weights.offload_dir else _disk_bytes_per_s(weights.offload_dir, io_threads)
    return TransferRates(link, disk, DEFAULT_BLOCK_BYTES, link_busy), direct


def measure_compute_costs(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          quantization: str) -> tuple[ComputeCosts, float]:
    """One layer's linear work, decode attention and the head on the GPU, weights in `quantization`;
    and the link's bytes/s beside that linear work."""
    layer_bytes = layer_image_bytes(model_config.shape, WeightFormat(quantization, dtype.itemsize))
    return _compute_costs(model_config, dtype, quantization, config.torch_device, engine_cores(config), layer_bytes)


def engine_cores(config: EngineConfig) -> CoreAssignment:
    cpu_attention = config.cpu_attention
    return CoreAssignment.for_device(config.device, cpu_attention.gpu_threads, cpu_attention.cpu_attention_threads)


@functools.lru_cache(maxsize=None)
def _link_bytes_per_s(device: str, cores: CoreAssignment) -> float:
    engine = _copy_engine(device, cores)
    try:
        return measure_link_bytes_per_s(engine)
    finally:
        engine.close()


@functools.lru_cache(maxsize=None)
def _disk_bytes_per_s(offload_dir: str, num_io_threads: int) -> tuple[float, bool]:
    reader = DirectReader(num_io_threads)
    try:
        return measure_disk_bytes_per_s(offload_dir, reader)
    finally:
        reader.close()


@functools.lru_cache(maxsize=None)
def _compute_costs(model_config: ModelConfig, dtype: torch.dtype, quantization: str, device: str,
                   cores: CoreAssignment, layer_bytes: int) -> tuple[ComputeCosts, float]:
    queue = _gpu_queue(cores, device)
    engine = _copy_engine(device, cores)
    try:
        return measure_compute(model_config, dtype, QUANTIZATION_METHODS[quantization], queue, layer_bytes, engine)
    finally:
        engine.close()
        queue.close()


def _copy_engine(device: str, cores: CoreAssignment):
    """The copy engine the streamed layers will use (as create_layer_store makes it)."""
    return create_copy_engine(device, cores.copy_threads, cores.cpu_attention_cores or None)


def _gpu_queue(cores: CoreAssignment, device: str) -> GpuQueue:
    if cores.device == "testbed":
        return WorkerThreadQueue(set(cores.gpu_cores), cores.gpu_threads, name="tandem-probe")
    if cores.device == "cuda":
        return CudaStreamQueue(device)
    return InlineQueue(device)


def planner_inputs(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int,
                   measured: Measurements) -> PlannerInputs:
    weights = config.weights
    return PlannerInputs(model_config.shape, weight_format(config, dtype), workload(config, max_model_len, dtype),
                         budgets(config, model_config, dtype), measured.rates, measured.costs,
                         mode=weights.placement, pipeline=weights.pipeline)


def plan_model(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
               max_model_len: int, expert_skew: float = DEFAULT_SKEW) -> tuple[ModelPlan, SlicingCosts | None]:
    """Each decoder layer's tier and MLP slice rates under this config (scheduler.planning's
    joint planner), with the slicing models they were solved with (None without slicing). Measures
    only what the plan needs: the slicing models (cached) where --mlp-slicing is on; the link,
    disk and compute only where whole layers may stream. PlacementError (a ValueError) when
    nothing fits; ConfigError for whole-layer streaming of a mixture-of-experts model. A MoE model
    whose experts do not fit --weights-gpu-gib gets the hot-expert cache (`plan_hot_experts`;
    `expert_skew`: the Zipf exponent its expected hit rate assumes)."""
    weights = config.weights
    num_layers = model_config.num_layers
    if expert_cache_requested(config, model_config):
        return plan_hot_experts(config, model_config, dtype, expert_skew), None
    fixed_rates = weights.slice_rates(num_layers)
    if fixed_rates is not None and not weights.streaming_requested:  # nothing to solve or fit: no measuring
        return ModelPlan.compose(num_layers, rates=fixed_rates), None
    sliced = weights.slicing_solved or fixed_rates is not None
    if weights.streaming_requested and not sliced:
        _refuse_moe_streaming(model_config)
    placement = None
    if weights.streaming_requested:
        def measured() -> tuple[TransferRates, ComputeCosts]:
            measurements = measure(config, model_config, dtype)
            return measurements.rates, measurements.costs
        placement = PlacementRequest(budgets(config, model_config, dtype),
                                     workload(config, max_model_len, dtype, model_config), measured,
                                     mode=weights.placement, pipeline=weights.pipeline)
    slicing = costs = None
    if sliced:
        costs = slicing_costs(config, model_config, dtype)
        prefill_tokens = workload(config, max_model_len).max_num_batched_tokens if weights.prefill_moving else None
        slicing = SlicingRequest(costs, config.max_num_seqs, weights.slice_rates(num_layers), prefill_tokens)
    return plan_layers(model_config.shape, weight_format(config, dtype), placement, slicing), costs


def expert_cache_requested(config: EngineConfig, model_config: ModelConfig) -> bool:
    """A MoE model with --hot-experts not off, no --mlp-slicing and no forced placement, under a
    weight budget or a fixed number of hot experts."""
    weights = config.weights
    if not model_config.is_moe or weights.hot_experts_off or weights.placement != "auto":
        return False
    if weights.slicing_solved or weights.slice_rates(model_config.num_layers) is not None:
        return False
    return weights.gpu_gib is not None or weights.hot_expert_slots is not None


def plan_hot_experts(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                     skew: float = DEFAULT_SKEW) -> ModelPlan:
    """Every layer resident but its routed experts, which the hot-expert cache holds: as many per
    layer on the GPU as --hot-experts says or --weights-gpu-gib leaves (every expert resident,
    without a cache, where all fit and --hot-experts is auto)."""
    weights = config.weights
    shape, fmt = model_config.shape, weight_format(config, dtype)
    budget = None if weights.gpu_gib is None else int(weights.gpu_gib * GIB_BYTES)
    num_fetch_buffers = 0 if config.device == "cpu" else DEFAULT_FETCH_BUFFERS  # nothing computes beside the CPU
    experts = plan_expert_cache(shape, fmt, resident_global_bytes(shape, fmt.dtype_bytes), budget,
                                weights.hot_expert_slots, num_fetch_buffers, weights.expert_window_tokens, skew)
    layers = ModelPlan.compose(shape.num_layers)
    if weights.hot_expert_slots is None and experts.num_slots == shape.num_experts:
        logger.info("hot experts: every expert fits --weights-gpu-gib, so all stay resident")
        return layers
    return ModelPlan(layers.layers, gpu_weight_bytes=experts.gpu_bytes, budget_bytes=budget, experts=experts)


def profile_key(config: EngineConfig, dtype: torch.dtype) -> ProfileKey:
    """The key of what is measured once per model, dtype, device and thread split (no cost tables)."""
    cores = engine_cores(config)
    return ProfileKey.create(model=config.model, load_format=config.load_format, dtype=dtype, device=config.device,
                             gpu_threads=cores.gpu_threads, cpu_attention_threads=cores.cpu_attention_threads,
                             block_size=config.cache.block_size)


def slicing_costs(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> SlicingCosts:
    """ScheInfer's linear models for this config: cached beside the cost tables under the same key
    (one file per weight format), else measured (engine/profiling/slicing_probe.py) and cached."""
    cpu_attention = config.cpu_attention
    cores = engine_cores(config)
    key = profile_key(config, dtype)
    method = QUANTIZATION_METHODS[config.quantization]
    kind = f"slicing-{method}"

    def build() -> SlicingCosts:
        logger.info("measuring the MLP slicing models (once per model/dtype/device and weight format)")
        queue = _gpu_queue(cores, config.torch_device)
        engine = _copy_engine(config.torch_device, cores)
        try:
            return measure_slicing_costs(model_config, dtype, method, queue, engine, cores)
        finally:
            engine.close()
            queue.close()

    if cpu_attention.force_profile:
        profile_path(key, cpu_attention.profile_cache_dir, kind).unlink(missing_ok=True)
    return load_or_measure(key, kind, build, SlicingCosts.to_dict, SlicingCosts.from_dict,
                           cpu_attention.profile_cache_dir)
