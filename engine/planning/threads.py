"""The engine's side of the thread planner (scheduler/planning/threads.py, LM-Offload's Algorithm 3):
an EngineConfig, the model plan and this machine's thread profiles turned into the planner's
inputs, in one place for `tandem plan` and `tandem serve`. Nothing here loads a weight.

The iteration planned for is a decode step of max_num_seqs sequences at the expected context
length (the weight planner's workload): the GPU's linear work reads the attention weights and
the GG, CG and streamed parts' MLP weights; the CPU side attends over the KV of as many of those
sequences as the host pool holds and computes the CC parts; the copy engine moves streamed
layers and CG parts; the disk reader reads disk-tier layers. Only the testbed has a compute split
to choose, so only there is the probe run (once per model, dtype and host; cached).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.device.cores import CoreAssignment, device_kind, host_cores
from engine.planning.weights import weight_format, workload
from engine.kv import KVCache
from engine.kv.layouts import resolve_kv_format
from engine.model_config import ModelConfig
from engine.profiling.cache import ProfileKey, load_or_measure, profile_path
from engine.profiling.thread_probe import ThreadProfiles, measure_thread_profiles
from scheduler.planning import ModelPlan, SliceRates, layer_image_bytes
from scheduler.planning.memory import linear_shapes
from scheduler.planning.slicing.plan import layer_works
from scheduler.planning.tiers import Tier
from scheduler.planning.threads import (
    CPU,
    CUDA,
    TESTBED,
    FixedThreads,
    IterationProfiles,
    TaskProfile,
    ThreadPlan,
    ThreadSplit,
    plan_threads,
)

logger = logging.getLogger(__name__)

THREAD_PROFILE_KIND = "threads"  # beside the cost tables in the profile cache: <digest>.threads.json
ATTENTION_LINEARS = ("qkv", "o_proj")


@dataclass(frozen=True)
class IterationVolumes:
    """What one decode iteration's host tasks read and move, in bytes."""

    gpu_weight_bytes: int  # weights the GPU's linear work reads
    cc_weight_bytes: int  # weights the CPU side's CC parts read
    cpu_kv_bytes: int  # KV the CPU decoding attention reads
    copy_bytes: int  # host -> GPU: streamed layers and CG parts
    io_bytes: int  # disk -> host: disk-tier layers


def plan_thread_split(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, model_plan: ModelPlan,
                      max_model_len: int, copy_threads: int | None = None,
                      profiles: ThreadProfiles | None = None) -> ThreadPlan:
    """The split of this host's cores for `config` serving `model_plan`: the counts the flags fix
    kept (`copy_threads`: the copy engine's, where given), the rest planned from `profiles`
    (default: this machine's, measured once and cached, on the testbed only). ValueError where the
    fixed counts leave the testbed no core for its CPU side."""
    kind = device_kind(config.device)
    volumes = iteration_volumes(config, model_config, dtype, model_plan, max_model_len)
    if profiles is None and kind == TESTBED:
        profiles = thread_profiles(config, model_config, dtype)
    work = iteration_profiles(profiles, volumes, kind) if profiles is not None else IterationProfiles()
    plan = plan_threads(len(host_cores()), kind, work, copy_bytes=volumes.copy_bytes, io_bytes=volumes.io_bytes,
                        fixed=fixed_threads(config, copy_threads))
    logger.info("threads: %s", plan.describe())
    return plan


def core_assignment(config: EngineConfig, split: ThreadSplit) -> CoreAssignment:
    """The cores of `split`; on device cpu the attention kernel keeps --cpu-attention-threads (or 1)."""
    return CoreAssignment.from_split(config.device, split, config.cpu_attention.cpu_attention_threads)


def fixed_threads(config: EngineConfig, copy_threads: int | None = None) -> FixedThreads:
    """The counts the flags fix: --gpu-threads on the testbed, --cpu-attention-threads off
    device cpu (there it counts the attention kernel's threads inside a forward torch's pool
    runs, not the CPU side's), --weight-io-threads, and `copy_threads`."""
    kind, cpu_attention = device_kind(config.device), config.cpu_attention
    return FixedThreads(gpu_threads=cpu_attention.gpu_threads if kind == TESTBED else None,
                        cpu_threads=cpu_attention.cpu_attention_threads if kind != CPU else None,
                        copy_threads=copy_threads, io_threads=config.weights.num_io_threads)


# ---- one iteration's work ---------------------------------------------------------------------
def iteration_volumes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, model_plan: ModelPlan,
                      max_model_len: int) -> IterationVolumes:
    """Each layer's share by its plan: streamed whole, it is read by the GPU and moved (and read
    from disk on the disk tier); resident, its MLP splits by its slice rates."""
    shape, fmt = model_config.shape, weight_format(config, dtype)
    shapes = linear_shapes(shape)
    attention_bytes = sum(sum(fmt.linear_tensor_bytes(*shapes[name])) for name in ATTENTION_LINEARS)
    layer_bytes = layer_image_bytes(shape, fmt)
    stored_mlp_bytes = layer_bytes - attention_bytes
    gpu_bytes = cc_bytes = copy_bytes = io_bytes = 0.0
    for layer, work in zip(model_plan.layers, layer_works(shape, fmt, config.max_num_seqs)):
        read_mlp_bytes = work.weight_bytes  # a MoE layer's: the experts the batch is expected to reach
        if layer.streamed:
            gpu_bytes += attention_bytes + read_mlp_bytes
            copy_bytes += layer_bytes
            io_bytes += layer_bytes if layer.tier == Tier.DISK else 0
            continue
        rates = layer.rates or SliceRates.resident()
        gpu_bytes += attention_bytes + (rates.cg + rates.gg) * read_mlp_bytes
        cc_bytes += rates.cc * read_mlp_bytes
        copy_bytes += rates.cg * stored_mlp_bytes
    return IterationVolumes(round(gpu_bytes), round(cc_bytes), cpu_kv_bytes(config, model_config, dtype, max_model_len),
                            round(copy_bytes), round(io_bytes))


def cpu_kv_bytes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int) -> int:
    """KV the CPU attention reads an iteration: of as many of max_num_seqs sequences at the
    expected context as the host pool holds (none without Neo's host pool)."""
    if not config.cpu_attention_enabled:
        return 0
    block_size = config.cache.block_size
    block_bytes = KVCache.bytes_per_block(model_config, block_size,
                                          resolve_kv_format(config.cache.kv_cache_dtype, dtype))
    context_len = workload(config, max_model_len).context_len
    num_cpu_seqs = min(config.max_num_seqs, config.cache.num_cpu_blocks_for(block_bytes) * block_size // context_len)
    return num_cpu_seqs * context_len * block_bytes // block_size


def iteration_profiles(profiles: ThreadProfiles, volumes: IterationVolumes, kind: str) -> IterationProfiles:
    """The probe's units scaled to the iteration's bytes: linear work by weight bytes, attention
    by KV bytes, copies by bytes moved. On cuda the GPU's work and its copies are not the host's."""
    gpu = _scaled(profiles.linear, volumes.gpu_weight_bytes, profiles.layer_weight_bytes)
    cc = _scaled(profiles.linear, volumes.cc_weight_bytes, profiles.layer_weight_bytes)
    attention = _scaled(profiles.attention, volumes.cpu_kv_bytes, profiles.attention_kv_bytes)
    cpu = _back_to_back(cc, attention)
    copy = _scaled(profiles.copy, volumes.copy_bytes, profiles.copy_bytes)
    if kind == CUDA:
        return IterationProfiles(cpu=cpu)
    return IterationProfiles(gpu=gpu, cpu=cpu, copy=copy)


def _back_to_back(first: TaskProfile | None, second: TaskProfile | None) -> TaskProfile | None:
    if first is None or second is None:
        return first or second
    return first.plus(second)


def _scaled(unit: TaskProfile, num_bytes: int, unit_bytes: int) -> TaskProfile | None:
    """`unit`'s task over `num_bytes` (None where there are none)."""
    return unit.scaled(num_bytes / unit_bytes) if num_bytes > 0 else None


# ---- the profile ------------------------------------------------------------------------------
def thread_profiles(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> ThreadProfiles:
    """This machine's thread profiles for the model's shape: cached beside the cost tables, else
    measured (engine/profiling/thread_probe.py) and cached. The key's thread fields say what was
    probed: every count up to the host's cores, so a change of affinity misses the cache."""
    cores = host_cores()
    key = ProfileKey.create(model=config.model, load_format=config.load_format, dtype=dtype, device=config.device,
                            gpu_threads=1, cpu_attention_threads=len(cores), block_size=config.cache.block_size)
    cpu_attention = config.cpu_attention

    def build() -> ThreadProfiles:
        logger.info("measuring the host tasks at each thread count (once per model/dtype/host)")
        return measure_thread_profiles(model_config, dtype, config.cache.block_size, cores)

    if cpu_attention.force_profile:
        profile_path(key, cpu_attention.profile_cache_dir, THREAD_PROFILE_KIND).unlink(missing_ok=True)
    return load_or_measure(key, THREAD_PROFILE_KIND, build, ThreadProfiles.to_dict, ThreadProfiles.from_dict,
                           cpu_attention.profile_cache_dir)
