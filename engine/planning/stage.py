"""The planning stage: how the engine will run, decided once.

`plan_engine` takes the config, the model's loader (its shape and format; no weight is loaded) and
this machine's measurements (probed, or read from the profile cache) and returns one `EnginePlan`:
the compute dtype, the fit's weight and KV formats and pool sizes (LM-Offload), each decoder layer's
tier and MLP slicing or expert cache (PIPO, ScheInfer), the KV pools, the host's threads
(Algorithm 3), tensor parallelism's ranks, and which scheduler runs over which cost model.
`tandem plan` prints that object; `LLMEngine` builds exactly what it says and decides nothing.
"""
from __future__ import annotations

import logging
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engine.config import GIB_BYTES, EngineConfig
from engine.device.cores import CoreAssignment, host_cores, rank_core_sets
from engine.device.memory import default_gpu_memory_bytes
from engine.distributed.partition import RankMemory, describe_ranks, largest_rank_config, rank_memories
from engine.distributed.stages import StageMemory, describe_stages, plan_stages, stage_memories
from engine.kv import KVCache
from engine.kv.layouts import resolve_kv_format
from engine.model_config import ConfigError, ModelConfig
from engine.planning.fit import describe_fit, fit_config
from engine.planning.threads import core_assignment, plan_thread_split
from engine.planning.weights import plan_model, slicing_costs, weight_format
from engine.profiling import compute_dtype
from engine.profiling.cache import ProfileKey, profile_path
from engine.weights import WeightLoader
from scheduler.planning import ModelPlan, SlicingCosts, describe_model_plan
from scheduler.planning.experts.hot_experts import DEFAULT_SKEW, describe_expert_speeds
from scheduler.planning.fit import Fit
from scheduler.planning.kv_format import KVFormat
from scheduler.planning.threads import ThreadPlan
from scheduler.planning.tiers import Tier

logger = logging.getLogger(__name__)

# Without an explicit max_model_len, contexts are capped here to keep prefill buffers sane.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass(frozen=True)
class GpuPoolPlan:
    """How the GPU KV pool is sized: a fixed number of blocks, or what `memory_gib` leaves once the
    weights are loaded (their bytes are known only then) and the activation reserve is set aside."""

    block_bytes: int  # one block of every layer's K and V on one rank, scales included
    num_blocks: int | None  # fixed; None: sized by memory_gib
    memory_gib: float | None = None
    reserve_gib: float | None = None  # the weight planner's activation estimate; None: the config's default

    def size(self, config: EngineConfig) -> int | Callable[[int], int]:
        """The pool's blocks, or how ModelRunner sizes it from the loaded weights' bytes."""
        if self.num_blocks is not None:
            return self.num_blocks
        cache, memory_gib, reserve_gib = config.cache, self.memory_gib, self.reserve_gib
        if reserve_gib is None:
            return lambda weight_bytes: cache.num_gpu_blocks_after(weight_bytes, self.block_bytes, memory_gib)
        return lambda weight_bytes: cache.num_gpu_blocks_after(weight_bytes, self.block_bytes, memory_gib, reserve_gib)

    def describe(self) -> str:
        if self.num_blocks is not None:
            return f"GPU pool {self.num_blocks} blocks ({self.num_blocks * self.block_bytes / GIB_BYTES:.2f} GiB)"
        return f"GPU pool: what {self.memory_gib:.2f} GiB leaves after the weights and activations"

    def to_dict(self) -> dict[str, Any]:
        return {"block_bytes": self.block_bytes, "num_blocks": self.num_blocks, "memory_gib": self.memory_gib,
                "reserve_gib": self.reserve_gib}


@dataclass(frozen=True)
class SchedulerPlan:
    """Which scheduler runs, with its token budget, and the cost model Neo's decides by."""

    kind: str  # "neo" (a host KV pool, CPU decoding attention) or "gpu-only"
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    max_prefill_slowdown: float
    max_prefill_stall_s: float = 0.0
    cost_tables: str | None = None  # a JSON file of tables given instead of a profile
    profile_key: ProfileKey | None = None  # what the profiled tables are cached under
    layer_costs: tuple[str, ...] = ()  # "streamed", "sliced": what stretches the linear stage

    def describe(self) -> str:
        caching = "on" if self.enable_prefix_caching else "off"
        bounds = [f"{self.max_prefill_slowdown:g} decode steps' time"] if self.max_prefill_slowdown else []
        bounds += [f"a decode step + {self.max_prefill_stall_s * 1000:g} ms"] if self.max_prefill_stall_s else []
        pacing = f", prompt chunks at most {' and '.join(bounds)} while streams decode" if bounds else ""
        text = (f"{self.kind}: {self.max_num_batched_tokens} tokens per iteration (longer prompts in chunks){pacing}, "
                f"prefix caching {caching}")
        if self.kind == "neo":
            source = f"tables from {self.cost_tables}" if self.cost_tables else "this machine's profile"
            extra = "".join(f", {name} layers' time" for name in self.layer_costs)
            text += f"; cost model: {source}{extra}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_num_batched_tokens": self.max_num_batched_tokens,
                "enable_prefix_caching": self.enable_prefix_caching,
                "max_prefill_slowdown": self.max_prefill_slowdown, "max_prefill_stall_s": self.max_prefill_stall_s,
                "cost_tables": self.cost_tables,
                "profile_key": None if self.profile_key is None else asdict(self.profile_key),
                "layer_costs": list(self.layer_costs)}


@dataclass(frozen=True)
class EnginePlan:
    """Everything decided about how the engine runs, before a weight is loaded."""

    config: EngineConfig  # the fit's choices in place of the auto and unset knobs
    model_config: ModelConfig  # the whole model
    rank_model_config: ModelConfig  # what one rank holds (the whole model without tensor parallelism)
    dtype: torch.dtype
    dtype_reason: str
    fit: Fit | None  # None where the flags placed the layers
    max_model_len: int  # before the GPU pool caps it
    layers: ModelPlan  # each decoder layer's tier, MLP slicing or expert cache
    slicing_costs: SlicingCosts | None  # the slicing models the plan was solved with, or its parts split by
    kv_format: KVFormat
    gpu_pool: GpuPoolPlan
    num_cpu_blocks: int  # the host pool (0: no CPU decoding attention)
    threads: ThreadPlan
    cores: CoreAssignment
    ranks: tuple[RankMemory, ...]
    stages: tuple[StageMemory, ...]  # pipeline stages (none without)
    stage_layers: tuple[ModelPlan, ...]  # each stage's plan of its own layers (`layers`: the largest stage's)
    scheduler: SchedulerPlan
    cuda_graph_max_batch: int  # the largest decode batch replayed as a CUDA graph (0: eager)

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's K and V of one token on one rank, scales included."""
        return self.gpu_pool.block_bytes // self.config.cache.block_size

    @property
    def profile_path(self) -> Path | None:
        """Where the scheduler's profiled cost tables are cached (None: none are profiled)."""
        key = self.scheduler.profile_key
        return None if key is None else profile_path(key, self.config.cpu_attention.profile_cache_dir)

    def to_dict(self) -> dict[str, Any]:
        """Every decision, as `tandem plan --json` prints it and the started engine holds it."""
        config = self.config
        return {"model": config.model, "device": config.device, "dtype": _dtype_name(self.dtype),
                "quantization": config.quantization, "max_model_len": self.max_model_len,
                "fit": None if self.fit is None else self.fit.to_dict(),
                "kv_cache": {"format": self.kv_format.name, "bytes_per_token": self.kv_bytes_per_token,
                             "gpu_pool": self.gpu_pool.to_dict(), "num_cpu_blocks": self.num_cpu_blocks},
                "threads": self.threads.to_dict(), "cores": _cores_dict(self.cores),
                "ranks": [memory.to_dict() for memory in self.ranks],
                "stages": [memory.to_dict() for memory in self.stages],
                "stage_layers": [plan.to_dict() for plan in self.stage_layers], "scheduler": self.scheduler.to_dict(),
                "cuda_graph_max_batch": self.cuda_graph_max_batch, "flags": fitted_flags(config),
                **self.layers.to_dict(),
                "slicing_costs": None if self.slicing_costs is None else self.slicing_costs.to_dict()}

    def describe(self) -> str:
        """The plan as `tandem plan` prints it."""
        config = self.config
        lines = [f"tandem plan: {config.model}, {_dtype_name(self.dtype)} ({self.dtype_reason}), "
                 f"{'int4 ' if config.quantization == 'int4' else ''}weights, on {config.device}",
                 describe_fit(self.fit, config),
                 f"as flags: {' '.join(fitted_flags(config))}",
                 f"scheduler: {self.scheduler.describe()}",
                 f"kv cache: {self.kv_format.describe()}; {self.kv_bytes_per_token} bytes a token; "
                 f"{self.gpu_pool.describe()}, host pool {self.num_cpu_blocks} blocks"]
        if self.stage_layers:  # each stage's own plan of its layers
            lines += [f"stage {index} {describe_model_plan(plan, config.weights.offload_dir)}"
                      for index, plan in enumerate(self.stage_layers)]
        else:
            lines.append(describe_model_plan(self.layers, config.weights.offload_dir))
        if self.layers.experts is not None and self.slicing_costs is not None:
            lines.append(describe_expert_speeds(self.layers.experts, self.rank_model_config.shape,
                                                weight_format(config, self.dtype), self.slicing_costs,
                                                config.max_num_seqs, config.batched_tokens_budget))
        lines.append(f"threads: {self.threads.describe()}")
        if config.parallel.tensor_parallel_size > 1:
            lines.append(describe_ranks(list(self.ranks)))
        if self.stages:
            lines.append(describe_stages(list(self.stages), config.parallel.tensor_parallel_size))
        return "\n".join(lines)


def plan_engine(config: EngineConfig, loader: WeightLoader, *, predict: bool = False,
                expert_skew: float = DEFAULT_SKEW) -> EnginePlan:
    """How the engine runs `loader`'s model under `config` on this machine. `predict`: also measure
    the expected speed where memory alone decides (`tandem plan`; it changes no decision).
    ConfigError, FitError or PlacementError naming the flag to change where nothing works."""
    model_config = loader.config
    dtype, dtype_reason = compute_dtype(config.dtype, config.torch_device)
    max_model_len = model_max_len(config, model_config)
    config, fitted = fit_config(config, loader, dtype, max_model_len, predict_always=predict)
    # every rank places its shard's layers by one plan, made for the largest shard (of the
    # largest stage); a smaller stage by a plan of its own size
    rank_model_config = _largest_stage(config, largest_rank_config(model_config, config.parallel.tensor_parallel_size))
    layers, costs = plan_model(config, rank_model_config, dtype, max_model_len, expert_skew=expert_skew)
    stage_layers = _stage_layer_plans(config, model_config, rank_model_config, dtype, max_model_len, layers)
    for plan in stage_layers or (layers,):
        _refuse_sharded_disk_tier(config, plan)
        _refuse_cached_experts_in_stages(config, plan)
    kv_format = _kv_format(config, dtype, model_config)
    block_bytes = KVCache.bytes_per_block(rank_model_config, config.cache.block_size, kv_format)
    num_cpu_blocks = config.cache.num_cpu_blocks_for(block_bytes) if config.cpu_attention_enabled else 0
    costs = costs or _slicing_costs_needed(config, rank_model_config, dtype, layers, num_cpu_blocks)
    threads = plan_thread_split(config, rank_model_config, dtype, layers, max_model_len,
                                copy_threads=config.weights.num_copy_threads)
    cores = _cores(config, threads)
    ranks = rank_memories(model_config, config.parallel.tensor_parallel_size, weight_format(config, dtype),
                          kv_format.element_bytes)
    return EnginePlan(
        config=config, model_config=model_config, rank_model_config=rank_model_config, dtype=dtype,
        dtype_reason=dtype_reason, fit=fitted, max_model_len=max_model_len, layers=layers, slicing_costs=costs,
        kv_format=kv_format, gpu_pool=_gpu_pool(config, block_bytes, layers), num_cpu_blocks=num_cpu_blocks,
        threads=threads, cores=cores, ranks=tuple(ranks), stages=tuple(_stages(config, model_config, dtype, kv_format)),
        stage_layers=stage_layers,
        scheduler=_scheduler_plan(config, dtype, layers, kv_format, cores, num_cpu_blocks),
        cuda_graph_max_batch=_cuda_graph_max_batch(config))


def model_max_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence the model will be asked for, before the KV pool caps it."""
    trained = model_config.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > trained:
            raise ConfigError(f"max_model_len ({config.max_model_len}) exceeds the model's context "
                              f"length ({trained})")
        return config.max_model_len
    return min(trained, DEFAULT_MAX_MODEL_LEN_CAP)


def fitted_flags(config: EngineConfig) -> list[str]:
    """The flags that run what the fit chose (`tandem serve` with them skips nothing it decides)."""
    cache, weights = config.cache, config.weights
    flags = [f"--quantization {config.quantization}", f"--kv-cache-dtype {cache.kv_cache_dtype}"]
    if config.max_num_batched_tokens is not None:
        flags.append(f"--max-num-batched-tokens {config.max_num_batched_tokens}")
    if cache.num_blocks is not None:
        flags.append(f"--num-gpu-blocks {cache.num_blocks}")
    if cache.num_cpu_blocks is not None:
        flags.append(f"--num-cpu-blocks {cache.num_cpu_blocks}")
    if weights.gpu_gib is not None:
        flags.append(f"--weights-gpu-gib {weights.gpu_gib:.6g}")
    if weights.host_gib is not None:
        flags.append(f"--weights-cpu-gib {weights.host_gib:.6g}")
    if weights.pipeline != "auto":
        flags.append(f"--weight-pipeline {weights.pipeline}")
    if weights.offload_dir:
        flags.append(f"--offload-dir {weights.offload_dir}")
    return flags


def _cores(config: EngineConfig, threads: ThreadPlan) -> CoreAssignment:
    """Which cores do what: the thread plan's split, or under tensor parallelism rank 0's own run
    of this host's cores (each rank pins to its run; on a Ray cluster of other hosts, this host's
    rules stand in for theirs)."""
    parallel = config.parallel
    if not parallel.enabled:
        return core_assignment(config, threads.split)
    rank_cores = rank_core_sets(host_cores(), parallel.num_ranks)[0] if parallel.ray_address is None else ()
    return CoreAssignment.for_rank(config.device, rank_cores)


def _stages(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, kv_format: KVFormat):
    num_stages = config.parallel.pipeline_parallel_size
    if num_stages == 1:
        return []
    return stage_memories(model_config, num_stages, weight_format(config, dtype), kv_format.element_bytes)


def _largest_stage(config: EngineConfig, rank_config: ModelConfig) -> ModelConfig:
    """What the largest pipeline stage's rank holds: its layers only (its KV pools, its plan)."""
    num_stages = config.parallel.pipeline_parallel_size
    if num_stages == 1:
        return rank_config
    return dataclasses.replace(rank_config, num_layers=max(stage.num_layers for stage in
                                                           plan_stages(rank_config, num_stages)))


def _stage_layer_plans(config: EngineConfig, model_config: ModelConfig, largest: ModelConfig, dtype: torch.dtype,
                       max_model_len: int, largest_plan: ModelPlan) -> tuple[ModelPlan, ...]:
    """Each pipeline stage's plan of its own layers under the per-node budgets (none without
    stages): the largest stage's, or one made for a stage a layer shorter."""
    num_stages = config.parallel.pipeline_parallel_size
    if num_stages == 1:
        return ()
    stages = plan_stages(model_config, num_stages)
    plans = {largest.num_layers: largest_plan}
    for stage in stages:
        if stage.num_layers not in plans:
            shorter = dataclasses.replace(largest, num_layers=stage.num_layers)
            plans[stage.num_layers] = plan_model(config, shorter, dtype, max_model_len)[0]
    return tuple(plans[stage.num_layers] for stage in stages)


def _refuse_cached_experts_in_stages(config: EngineConfig, layers: ModelPlan) -> None:
    stages = config.parallel.pipeline_parallel_size
    if stages > 1 and layers.experts is not None:
        raise ConfigError(f"--pipeline-parallel-size {stages}: the hot-expert cache in pipeline stages is not built "
                          f"(drop --hot-experts, or use --pipeline-parallel-size 1)")


def _refuse_sharded_disk_tier(config: EngineConfig, layers: ModelPlan) -> None:
    if config.parallel.enabled and layers.num_layers_in(Tier.DISK):
        raise ConfigError(f"--tensor-parallel-size {config.parallel.tensor_parallel_size}: the plan streams layers "
                          f"from disk, and a rank's shard of the offload directory is not built; give each rank "
                          f"more --weights-cpu-gib (host memory) or --weights-gpu-gib, and no --weight-placement "
                          f"disk")


def _kv_format(config: EngineConfig, dtype: torch.dtype, model_config: ModelConfig) -> KVFormat:
    """--kv-cache-dtype resolved (auto: the compute dtype's); ConfigError where the model's heads
    cannot take it."""
    fmt = resolve_kv_format(config.cache.kv_cache_dtype, dtype)
    problem = fmt.check_head_dim(model_config.head_dim)
    if problem:
        raise ConfigError(problem)
    return fmt


def _slicing_costs_needed(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, layers: ModelPlan,
                          num_cpu_blocks: int) -> SlicingCosts | None:
    """The slicing models (measured once and cached) where something beyond the slicing solver
    reads them: the hot-expert cache's split of each forward (and its expected speeds), the prefill
    tokens moved to CG', and the cost model of sliced MLPs. On device cpu nothing computes beside
    the CPU, so neither a split nor a move has two sides to weigh."""
    beside_cpu = config.device != "cpu"
    if layers.experts is not None:
        return slicing_costs(config, model_config, dtype) if beside_cpu else None
    if layers.rates is None:
        return None
    moving = config.weights.prefill_moving and beside_cpu
    return slicing_costs(config, model_config, dtype) if moving or num_cpu_blocks else None


def _gpu_pool(config: EngineConfig, block_bytes: int, layers: ModelPlan) -> GpuPoolPlan:
    """The GPU pool: --num-gpu-blocks or --kv-cache-gib as given, else what --memory-gib (on CUDA
    by default the one GPU memory rule, engine/device/memory.py) leaves after the weights and the
    weight planner's activation estimate."""
    cache = config.cache
    memory_gib = cache.memory_gib if cache.sized_by_memory_budget else None
    if memory_gib is None and _device_memory_default_applies(config):
        memory_gib = default_gpu_memory_bytes(config.torch_device) / GIB_BYTES
    if memory_gib is None:
        return GpuPoolPlan(block_bytes, cache.num_gpu_blocks_for(block_bytes))
    placement = layers.placement
    reserve_gib = None if placement is None else placement.memory.activation_bytes / GIB_BYTES
    return GpuPoolPlan(block_bytes, None, memory_gib, reserve_gib)


def _device_memory_default_applies(config: EngineConfig) -> bool:
    cache = config.cache
    unset = cache.num_blocks is None and cache.kv_cache_memory_gib is None and cache.memory_gib is None
    return unset and config.device.startswith("cuda")


def _scheduler_plan(config: EngineConfig, dtype: torch.dtype, layers: ModelPlan, kv_format: KVFormat,
                    cores: CoreAssignment, num_cpu_blocks: int) -> SchedulerPlan:
    """Neo's scheduler where a host pool exists, over the given tables or this machine's profile
    (cached under the key of what it measures), stretched by streamed layers and sliced MLPs."""
    common = dict(max_num_batched_tokens=config.batched_tokens_budget,
                  enable_prefix_caching=config.cache.enable_prefix_caching,
                  max_prefill_slowdown=config.prefill_slowdown_limit, max_prefill_stall_s=config.prefill_stall_limit_s)
    if not num_cpu_blocks:
        return SchedulerPlan("gpu-only", **common)
    placement = layers.placement
    layer_costs = (("streamed",) if placement is not None and placement.streamed_layers else ()) + \
        (("sliced",) if layers.rates is not None else ())
    tables = config.cpu_attention.cost_tables
    key = None if tables else ProfileKey.create(
        model=config.model, load_format=config.load_format, dtype=dtype, device=config.device,
        gpu_threads=cores.gpu_threads, cpu_attention_threads=cores.cpu_attention_threads,
        block_size=config.cache.block_size, linear_weights=_linear_weights_key(config, layers),
        kv_cache_dtype=kv_format.name)
    return SchedulerPlan("neo", **common, cost_tables=tables, profile_key=key, layer_costs=layer_costs)


def _linear_weights_key(config: EngineConfig, layers: ModelPlan) -> str:
    """What the linear stages compute from, for the profile's key: the format, and the slicing or
    the hot-expert cache; under tensor parallelism each rank profiles its shard, waiting on the
    others' collectives."""
    rates, experts = layers.rates, layers.experts
    if experts is not None:  # the experts the GPU does not hold compute on the CPU
        key = f"{config.quantization}, {experts.num_slots} of {experts.num_experts} experts hot per layer"
    elif rates is None:
        key = config.quantization
    else:
        key = f"{config.quantization}, MLPs sliced cc/cg/gg " + " ".join(f"{r.cc:g}/{r.cg:g}/{r.gg:g}" for r in rates)
    parallel = config.parallel
    return f"{key}, rank 0 of {parallel.tensor_parallel_size}" if parallel.enabled else key


def _cuda_graph_max_batch(config: EngineConfig) -> int:
    """Every decode batch the scheduler makes is replayed as a CUDA graph, on CUDA and unless
    --enforce-eager."""
    return 0 if config.enforce_eager or not config.device.startswith("cuda") else config.max_num_seqs


def _cores_dict(cores: CoreAssignment) -> dict[str, Any]:
    return {"device": cores.device, "gpu_cores": sorted(cores.gpu_cores),
            "cpu_attention_cores": sorted(cores.cpu_attention_cores),
            "cpu_attention_threads": cores.cpu_attention_threads, "copy_threads": cores.copy_threads}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
