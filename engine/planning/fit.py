"""The engine's side of the fit (scheduler/planning/fit, LM-Offload): an EngineConfig whose `auto` choices
(weight format, KV format) and unset memory knobs (layer placement, both KV pools) are decided
from two budgets, `--gpu-memory-gib` and `--host-memory-gib`, and this machine's measurements.

The fit's answer is an EngineConfig with those knobs set, so the engine runs exactly what a user
giving the same flags would run. Flags a user gives stay as given: a fixed weight or KV format
leaves only that option; --num-gpu-blocks, --kv-cache-gib, --num-cpu-blocks and
--cpu-kv-cache-gib fix the pools; the placement knobs (--weights-gpu-gib, --weights-cpu-gib,
--weight-placement, --mlp-slicing) and the older --memory-gib leave the layers and the pool to
the placement and slicing planners as before, the fit taking the lossless formats. Measuring
happens only where speed decides.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path

import torch

from engine.config import GIB_BYTES, EngineConfig
from engine.device.memory import default_gpu_memory_bytes
from engine.planning.weights import (
    HOST_MEMORY_FRACTION,
    available_host_bytes,
    engine_cores,
    measure_compute_costs,
    measure_rates,
    workload,
)
from engine.kv import KVCache
from engine.model_config import ConfigError, ModelConfig
from engine.profiling.attention_probe import measure_attention_s_per_token
from engine.profiling.cache import cache_root
from engine.weights import WeightLoader
from engine.weights.layer_files import room_bytes
from scheduler.planning.fit import (AttentionCosts, Configuration, Fit, FitBudgets, FitError, FitOption, FitProbes,
                                    FitRequest, FixedChoices, fit)
from scheduler.planning.fit.speculation import ACCEPTANCE_PRIOR, SpeculationGain
from scheduler.planning.kv_format import QUANTIZED_KV_BLOCK_MULTIPLE, KVFormat, kv_format
from scheduler.planning import WeightFormat, layer_image_bytes
from scheduler.planning.memory import resident_global_bytes

logger = logging.getLogger(__name__)

# A MoE model over the GPU's budget: the share its weights take (the hot-expert cache in what its
# other weights leave), the KV pool the rest.
MOE_WEIGHT_SHARE = 0.8

# The lossy KV formats in the order the fit weighs them: the least lossy first.
LOSSY_KV_FORMATS = ("int8", "k8v4", "int4")  # in the order of what they cost in accuracy (docs/benchmarks.md)
# Added to a fitted weight budget, so that the bytes a placement was chosen for survive GiB's rounding.
BUDGET_SLACK_BYTES = 1024


def fit_config(config: EngineConfig, loader: WeightLoader, dtype: torch.dtype, max_model_len: int,
               predict_always: bool = False) -> tuple[EngineConfig, Fit | None]:
    """`config` with the fit's choices in place of its auto and unset knobs, and the fit (None where
    the user placed the layers); FitError, a PlacementError, where nothing fits, naming the flag
    to change."""
    options = fit_options(config, loader.stores_int4(), dtype, loader.config.head_dim)
    if _placement_pinned(config, loader.config):
        if config.ttft_target_s is not None:
            raise ConfigError("--ttft-target-s guides the fit's choice of formats and placement, and the flags given "
                              "place the layers themselves (--weights-gpu-gib / --weights-cpu-gib / "
                              "--weight-placement / --mlp-slicing / --memory-gib / parallelism): drop one or the other")
        if loader.config.is_moe and not config.weights.streaming_requested:
            config = _fit_moe(config, loader, dtype, options[0])
        return _lossless(config, options[0]), None
    offload_dir = _offload_dir(config, loader)
    result = fit(fit_request(config, loader, dtype, max_model_len, predict_always, options))
    return apply_fit(config, result, loader.config, offload_dir), result


def fit_request(config: EngineConfig, loader: WeightLoader, dtype: torch.dtype, max_model_len: int,
                predict_always: bool = False, options: tuple[FitOption, ...] | None = None) -> FitRequest:
    """What the fit weighs for `config`: its options (`fit_options` where not given), budgets,
    workload and fixed choices, and how to measure this machine."""
    model_config = loader.config
    options = options or fit_options(config, loader.stores_int4(), dtype, model_config.head_dim)
    offload_dir = _offload_dir(config, loader)
    return FitRequest(model_config.shape, dtype.itemsize, options, workload(config, max_model_len, dtype),
                      fit_budgets(config, offload_dir),
                      lambda: measure_probes(config, model_config, dtype, options, offload_dir),
                      fixed_choices(config), predict_always=predict_always, ttft_target_s=config.ttft_target_s)


def _offload_dir(config: EngineConfig, loader: WeightLoader) -> str:
    return config.weights.offload_dir or default_offload_dir(loader.source)


def _fit_moe(config: EngineConfig, loader: WeightLoader, dtype: torch.dtype, option: FitOption) -> EngineConfig:
    """A mixture-of-experts model's layers do not stream whole: where its weights exceed the GPU's
    budget, the hot-expert cache takes MOE_WEIGHT_SHARE of it and the GPU's KV pool the rest (where
    no flag sizes the pool); with the cache off or slicing asked for, FitError naming the flags
    that place its experts."""
    shape = loader.config.shape
    fmt = WeightFormat(option.quantization, dtype.itemsize)
    weight_bytes = resident_global_bytes(shape, fmt.dtype_bytes) + shape.num_layers * layer_image_bytes(shape, fmt)
    budgets = fit_budgets(config, _offload_dir(config, loader))
    room = budgets.host_bytes if budgets.shared_memory else budgets.gpu_bytes
    if weight_bytes <= room:
        return config
    weights = config.weights
    if budgets.shared_memory or weights.hot_experts_off or weights.mlp_slicing.enabled:
        raise FitError(f"{loader.config.architecture}: its weights ({weight_bytes / GIB_BYTES:.1f} GiB as "
                       f"{option.quantization}) exceed the GPU's {room / GIB_BYTES:.1f} GiB, and a mixture-of-experts "
                       f"model's layers do not stream whole: keep its hottest experts on the GPU with --hot-experts "
                       f"auto --weights-gpu-gib {MOE_WEIGHT_SHARE * room / GIB_BYTES:.1f}, or place them with "
                       f"--mlp-slicing auto")
    cache = config.cache
    if cache.num_blocks is None and cache.kv_cache_memory_gib is None:
        block_bytes = KVCache.bytes_per_block(loader.config, cache.block_size, option.kv)
        cache = dataclasses.replace(cache, num_blocks=int((1 - MOE_WEIGHT_SHARE) * room) // block_bytes)
    logger.info("fit: %s's weights (%.2f GiB) exceed the GPU's %.2f GiB: its hottest experts stay on the GPU in "
                "%.2f GiB of weights, the CPU computes the rest", loader.config.architecture, weight_bytes / GIB_BYTES,
                room / GIB_BYTES, MOE_WEIGHT_SHARE * room / GIB_BYTES)
    weights = dataclasses.replace(weights, gpu_gib=MOE_WEIGHT_SHARE * room / GIB_BYTES)
    return dataclasses.replace(config, cache=cache, weights=weights)


def _lossless(config: EngineConfig, option: FitOption) -> EngineConfig:
    """Where the user placed the layers (or slicing places a MoE model's experts), the fit only
    resolves the formats, losslessly; the placement and slicing planners do the rest as before."""
    return dataclasses.replace(config, quantization=option.quantization,
                               cache=dataclasses.replace(config.cache, kv_cache_dtype=option.kv.name))


def fit_options(config: EngineConfig, stores_int4: bool, dtype: torch.dtype, head_dim: int) -> tuple[FitOption, ...]:
    """The (weight format, KV format) pairs the fit may choose, the lossless one first and each
    next one lossier: KV int8, weights int4 by round-to-nearest, both; then KV k8v4 (8-bit keys,
    4-bit values) and KV int4, each with the weights as stored and in int4."""
    int4_runs = config.device != "testbed"  # EngineConfig says why the testbed takes none
    if config.quantization != "auto":
        weights = [config.quantization]
    else:
        lossless = "int4" if stores_int4 and int4_runs else "none"
        weights = [lossless] + (["int4"] if lossless == "none" and int4_runs else [])
    dtype_kv = kv_format(str(dtype).removeprefix("torch."))
    if config.cache.kv_cache_dtype != "auto":
        kvs = [kv_format(config.cache.kv_cache_dtype)]
    else:
        kvs = [dtype_kv] + [kv_format(name) for name in LOSSY_KV_FORMATS
                            if _kv_format_fits(kv_format(name), head_dim, config.cache.block_size)]
    # as the loss grows: KV int8 loses less than 4-bit weights, which lose less than KV k8v4 and int4
    pairs = [(w, kv) for w in weights for kv in kvs[:2]] + [(w, kv) for kv in kvs[2:] for w in weights]
    return tuple(FitOption(w, kv, rank) for rank, (w, kv) in enumerate(pairs))


def _kv_format_fits(fmt: KVFormat, head_dim: int, block_size: int) -> bool:
    return fmt.check_head_dim(head_dim) is None and block_size % QUANTIZED_KV_BLOCK_MULTIPLE == 0


def _placement_pinned(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the user placed the layers or sized the GPU by the older --memory-gib (the pool takes
    what the weights leave), a MoE model's experts are placed by slicing only, or the model is split
    over tensor-parallel ranks (each holds its shard resident)."""
    weights = config.weights
    return (weights.streaming_requested or weights.host_gib is not None or weights.mlp_slicing.enabled
            or config.cache.memory_gib is not None or model_config.is_moe or config.parallel.enabled)


def fit_budgets(config: EngineConfig, offload_dir: str) -> FitBudgets:
    """The two budgets in bytes, and whether the pools take what they leave (a budget given, or a
    CUDA device's memory); on device cpu and the testbed with no GPU budget the GPU's memory is the
    host's."""
    host_bytes = int(config.host_memory_gib * GIB_BYTES if config.host_memory_gib
                     else HOST_MEMORY_FRACTION * available_host_bytes())
    gpu_gib = config.gpu_memory_gib
    cuda = config.device.startswith("cuda")
    if gpu_gib:
        gpu_bytes, shared = int(gpu_gib * GIB_BYTES), False
    elif cuda:
        gpu_bytes, shared = default_gpu_memory_bytes(config.torch_device), False
    else:
        gpu_bytes, shared = host_bytes, True
    pools_by_budget = cuda or bool(gpu_gib) or config.host_memory_gib is not None
    return FitBudgets(gpu_bytes, host_bytes, _free_disk_bytes(offload_dir), shared, pools_by_budget,
                      neo=config.cpu_attention_enabled)


def _free_disk_bytes(directory: str) -> int | None:
    """Room for layer files where `directory` is or would be created (free bytes, and those of the
    layer files already there); None where nothing can be written."""
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return room_bytes(path) if os.access(path, os.W_OK) else None
    except OSError:
        return None


def default_offload_dir(source: str) -> str:
    """Where disk-tier layers go when no --offload-dir is given: a directory per checkpoint under
    $TANDEM_CACHE_DIR (else ~/.cache/tandem)."""
    return str(cache_root() / "offload" / hashlib.sha256(source.encode()).hexdigest()[:16])


def fixed_choices(config: EngineConfig) -> FixedChoices:
    cache, weights = config.cache, config.weights
    gib = lambda value: None if value is None else int(value * GIB_BYTES)  # noqa: E731
    return FixedChoices(
        gpu_kv_blocks=cache.num_blocks, gpu_kv_bytes=gib(cache.kv_cache_memory_gib),
        host_kv_blocks=cache.num_cpu_blocks, host_kv_bytes=gib(cache.cpu_kv_cache_memory_gib),
        gpu_weight_bytes=gib(weights.gpu_gib), host_weight_bytes=gib(weights.host_gib),
        placement=weights.placement, pipeline=weights.pipeline,
        max_model_len=config.max_model_len is not None,
        max_num_batched_tokens=config.max_num_batched_tokens is not None)


def measure_probes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                   options: tuple[FitOption, ...], offload_dir: str) -> FitProbes:
    """This machine's rates, compute costs (per weight format, on first use) and attention per KV format."""
    measured = dataclasses.replace(config, weights=dataclasses.replace(config.weights, offload_dir=offload_dir))
    def compute_costs(quantization: str):  # measured once per process (weight_plan caches them)
        return measure_compute_costs(measured, model_config, dtype, quantization)[0]

    _, link_busy = measure_compute_costs(measured, model_config, dtype, options[0].quantization)
    rates, _ = measure_rates(measured, link_busy)
    kv_names = list(dict.fromkeys(option.kv.name for option in options))
    attention = measure_attention(config, model_config, dtype, kv_names, compute_costs(options[0].quantization))
    logger.info("fit: measured link %.2f GB/s%s; attention per 1k context tokens a layer: %s",
                rates.link_bytes_per_s / 1e9,
                "" if rates.disk_bytes_per_s is None else f", disk {rates.disk_bytes_per_s / 1e9:.2f} GB/s",
                ", ".join(f"{name} GPU {attention.gpu_s_per_token[name] * 1e9:.0f} us / CPU "
                          f"{attention.cpu_s_per_token[name] * 1e9:.0f} us" for name in kv_names))
    return FitProbes(rates, compute_costs, attention)


def measure_attention(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, kv_names: list[str],
                      costs) -> AttentionCosts:
    """Decode attention per context token and KV format: the CPU side's with its threads (the C++
    kernel); the GPU's the same kernel on the GPU's threads where the GPU is the host's cores, on
    CUDA the measured read rate over the format's bytes."""
    cores = engine_cores(config)
    block_size = config.cache.block_size
    cpu = {name: measure_attention_s_per_token(model_config, dtype, name, block_size, cores.cpu_attention_threads)
           for name in kv_names}
    if config.device.startswith("cuda"):
        dtype_bytes = dtype.itemsize
        gpu = {name: costs.attention_s_per_context_token * kv_format(name).element_bytes / dtype_bytes
               for name in kv_names}
    else:
        gpu = {name: measure_attention_s_per_token(model_config, dtype, name, block_size, cores.gpu_threads)
               for name in kv_names}
    return AttentionCosts(gpu, cpu, copies_on_cpu=not config.device.startswith("cuda"))


def apply_fit(config: EngineConfig, result: Fit, model_config: ModelConfig, offload_dir: str) -> EngineConfig:
    """`config` running the fit's choice: its formats, its pools (where no flag fixes them), its layers'
    placement (where the user did not place them)."""
    chosen, cache = result.chosen, config.cache
    block_bytes = KVCache.bytes_per_block(model_config, cache.block_size, chosen.option.kv)
    cache_changes: dict = {"kv_cache_dtype": chosen.option.kv.name}
    if cache.num_blocks is None and cache.kv_cache_memory_gib is None and cache.memory_gib is None:
        cache_changes["num_blocks"] = chosen.gpu_kv_bytes // block_bytes
    if config.cpu_attention_enabled and cache.num_cpu_blocks is None and cache.cpu_kv_cache_memory_gib is None:
        cache_changes["num_cpu_blocks"] = chosen.host_kv_bytes // block_bytes
    weights = config.weights
    if chosen.streams:
        weights = dataclasses.replace(
            weights, gpu_gib=(chosen.gpu_weight_bytes + BUDGET_SLACK_BYTES) / GIB_BYTES,
            host_gib=(chosen.host_layer_bytes + BUDGET_SLACK_BYTES) / GIB_BYTES, pipeline=chosen.pipeline,
            offload_dir=offload_dir if chosen.disk_layer_bytes else weights.offload_dir)
    chunk_budget = result.max_num_batched_tokens or config.max_num_batched_tokens
    return dataclasses.replace(config, quantization=chosen.option.quantization, max_num_batched_tokens=chunk_budget,
                               cache=dataclasses.replace(cache, **cache_changes), weights=weights)


def _describe_speculation(gain: SpeculationGain, config: EngineConfig) -> str:
    spec = config.speculative_config
    unpriced = ", the draft model's own steps not counted" if spec.method == "draft_model" else ""
    drafts = (f"{gain.num_drafts} drafts a sequence give {gain.speedup:.2f}x the tokens/s" if gain.num_drafts
              else "no draft pays (the forward's rows are not cheap enough)")
    return (f"  speculation ({spec.method}, at most {spec.num_speculative_tokens} drafts) at {gain.num_seqs} "
            f"sequences, {ACCEPTANCE_PRIOR:.0%} of drafts accepted: {drafts}{unpriced}")


SAME_SHARE = 0.005  # differences this small (of a ratio, or of a GiB) are not worth a word


def _describe_alternative(other: Configuration, chosen: Configuration) -> str:
    """A configuration the fit weighed and did not take: its prediction, memory and what it gives up
    against the chosen one."""
    p, q = other.prediction, chosen.prediction
    gives_up = []
    if p.tokens_per_s < q.tokens_per_s * (1 - SAME_SHARE):
        gives_up.append(f"{p.tokens_per_s / q.tokens_per_s:.2f}x the tokens/s")
    if q.ttft_s and p.ttft_s > q.ttft_s * (1 + SAME_SHARE):
        gives_up.append(f"{p.ttft_s / q.ttft_s:.2f}x the TTFT")
    if other.option.loss_rank > chosen.option.loss_rank:
        gives_up.append("lossier formats")
    if other.num_resident < chosen.num_resident:
        gives_up.append(f"{chosen.num_resident - other.num_resident} more layers streamed")
    if other.host_bytes - chosen.host_bytes > SAME_SHARE * GIB_BYTES:
        gives_up.append(f"{(other.host_bytes - chosen.host_bytes) / GIB_BYTES:.2f} GiB more host memory")
    return (f"  weighed: {other.option.describe()}: {p.tokens_per_s:.1f} tokens/s, TTFT {p.ttft_s:.2f} s; GPU "
            f"{other.gpu_bytes / GIB_BYTES:.2f} GiB, host {other.host_bytes / GIB_BYTES:.2f} GiB, "
            f"{other.num_resident} of {len(other.tiers)} layers resident; gives up "
            f"{', '.join(gives_up) or 'nothing predicted (ties go to the less lossy)'}")


def describe_fit(result: Fit | None, config: EngineConfig) -> str:
    """The fit's choice as `tandem plan` prints it and the engine logs it."""
    if result is None:
        return (f"fit: weights {config.quantization}, KV {config.cache.kv_cache_dtype} (lossless; the layers are "
                f"placed by the flags given, --weights-gpu-gib / --weights-cpu-gib / --weight-placement / "
                f"--mlp-slicing / --memory-gib)")
    c = result.chosen
    gib = lambda nbytes: f"{nbytes / GIB_BYTES:.2f}"  # noqa: E731
    lines = [f"fit: weights {c.option.quantization}, {c.option.kv.describe()} ({result.reason})",
             f"  GPU {gib(c.gpu_bytes)} GiB: weights and layer buffers {gib(c.gpu_weight_bytes)}, "
             f"activations {gib(c.activation_bytes)}, KV pool {gib(c.gpu_kv_bytes)}",
             f"  host {gib(c.host_bytes)} GiB: streamed layers and staging {gib(c.host_layer_bytes)}, "
             f"KV pool {gib(c.host_kv_bytes)}; disk {gib(c.disk_layer_bytes)} GiB"]
    if c.prediction is not None:
        p = c.prediction
        context_len = min(config.weights.expected_context_len or c.max_model_len, c.max_model_len)
        lines.append(f"  expected at {config.max_num_seqs} sequences of {context_len} "
                     f"tokens: {p.tokens_per_s:.1f} tokens/s (batch {p.batch}, {p.num_cpu_seqs} attended on the CPU; "
                     f"GPU {p.gpu_s * 1e3:.1f} ms, CPU {p.cpu_s * 1e3:.1f} ms an iteration), TTFT {p.ttft_s:.2f} s"
                     + ("" if config.ttft_target_s is None else f" (target {config.ttft_target_s:g} s)"))
        lines += [_describe_speculation(gain, config) for gain in p.speculation]
    lines += [_describe_alternative(other, c) for other in sorted(
        result.options, key=lambda o: -o.prediction.tokens_per_s if o.prediction else 0.0)
        if other is not c and other.prediction is not None]
    for option, why in result.refused.items():
        lines.append(f"  does not fit: {option}: {why}")
    return "\n".join(lines)
