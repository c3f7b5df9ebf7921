"""The engine's configuration: small frozen configs, each validated once, when it is built.

`EngineConfig` composes `CacheConfig`, `CpuAttentionConfig`, the Neo scheduler's `NeoKnobs`,
`WeightsConfig` (where weights live) and `ParallelConfig`. Every knob a user sets is declared
here once, as a field: `knob(flag, default, help, group)` (engine/knobs.py). The CLI's flags, the
YAML keys and TANDEM_ variables, and the keywords of `LLM(...)` and `EngineConfig.from_flat` are
generated from these declarations (ENGINE_KNOBS, FLAT_NAMES). Derived values are properties that
do no I/O: the compute dtype that `dtype="auto"` stands for is measured by `LLMEngine` when it
starts, not here. No torch here.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from engine.knobs import Group, config_knobs, flat_names, keyword_of, knob, parse_knobs, sections
from engine.model_config import ConfigError
from engine.speculative_config import SpeculativeConfig
from scheduler.modes import Mode
from scheduler.planning.kv_format import KV_CACHE_DTYPES, QUANTIZED_KV_BLOCK_MULTIPLE, kv_format
from scheduler.planning.memory import Quantization
from scheduler.neo import NeoKnobs
from scheduler.planning.slicing.rates import MlpSlicing, SliceRates
from scheduler.planning.placement import PlacementMode, WeightPipeline
from scheduler.planning.experts.hot_experts import (DEFAULT_WINDOW_TOKENS, NUM_WINDOW_BUCKETS, HotExperts,
                                                    parse_hot_experts)

# Compute dtype names a user may give -> torch's names for them (the short ones are aliases).
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


class CpuAttention(Mode):
    """--cpu-attention: whether some sequences' KV lives in a host pool, their decoding attention
    on the CPU (Neo)."""

    AUTO = "auto"  # on for testbed and cuda, off for cpu
    ON = "on"  # also on device cpu (everything serial: how tests check identical tokens)
    OFF = "off"  # GPU-only


class CpuOps(Mode):
    """--cpu-ops: how a CPU model's decoder layers run, fastest first."""

    LAYERS = "layers"  # a decode batch's layers in one C++ call (engine/model/native.py)
    FUSED = "fused"  # op by op from Python, RMSNorm, RoPE and SiLU*up as C++ kernels
    TORCH = "torch"  # every op a torch op


class Int4Prefill(Mode):
    """--int4-prefill: how the CPU's INT4 weights multiply a forward of more than 64 rows
    (engine/quant/int4.py; decode-sized batches quantize x to int16 whatever the choice)."""

    DEQUANTIZE = "dequantize"  # each weight widened into a scratch buffer for torch's GEMM: exact
    INT8 = "int8"  # x quantized to int8 per block of 32, integer dot products: as fast as dense, not exact
    INT16 = "int16"  # decode's own kernel at every row count: a row's bits whatever its chunk (--batch-invariant)


class LoadFormat(Mode):
    """--load-format: how --model is read (engine/weights)."""

    AUTO = "auto"  # from --model: a .gguf file, a directory, a preset
    GGUF = "gguf"
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"  # a preset's shape with random weights


class Switch(Mode):
    """A knob that is on or off by those words (--mlp-prefill-moving)."""

    ON = "on"
    OFF = "off"


# --quantization -> the linear method (engine/quant) every decoder-layer matmul uses
QUANTIZATION_METHODS = {Quantization.NONE: "dense", Quantization.INT4: "int4"}
PROFILE_GRIDS = ("default", "quick")  # quick: a coarse profile, for tests
# cpu: the CPU plays both roles; testbed: a GPU thread on its own cores beside the CPU
# attention (Neo's overlap on a CPU-only host); cuda[:N]: a GPU
_DEVICE_PATTERN = re.compile(r"cpu|testbed|cuda(:\d+)?")
GIB_BYTES = 2**30
log = logging.getLogger(__name__)


# The checks below name a field by its knob's keyword (keyword_of): the word the user gave.
def _require_int(config: object, name: str, minimum: int, none_means: str | None = None) -> None:
    """`config.<name>` must be an integer >= minimum; or None, where `none_means` says what None does."""
    value = getattr(config, name)
    if value is None and none_means is not None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        alternative = f" or None ({none_means})" if none_means is not None else ""
        raise ConfigError(f"{keyword_of(type(config), name)} must be an integer >= {minimum}{alternative}, "
                          f"got {value!r}")


def _require_positive(config: object, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{keyword_of(type(config), name)} must be a number > 0, got {value!r}")


def _require_choice(config: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ConfigError(f"{keyword_of(type(config), name)} must be one of {', '.join(choices)}, got {value!r}")


def _blocks_in(memory_gib: float, block_bytes: int) -> int:
    return max(1, int(memory_gib * GIB_BYTES // block_bytes))


# The iteration's token budget per device when --max-num-batched-tokens is not given. Prefill
# pacing keeps chunk steps short while streams decode, so the budget sets the prefill rate when
# none do: on cpu it still rose to 2048 (benchmarks/serving/chunk_budget.py, docs/benchmarks.md); cuda:
# vLLM's default for chunked prefill, unmeasured here.
DEFAULT_BATCHED_TOKENS = {"cuda": 2048, "cpu": 2048, "testbed": 2048}
# Prefill pacing's default per device. On a CPU a prefill token costs a sizeable share of a decode
# step and its attention grows with the prompt: unpaced, a long prompt stalls running streams for
# tens of decode steps. On CUDA, unmeasured here, the token budget alone (vLLM's behaviour).
# Prefill pacing's defaults by device, where neither pacing flag is given (0: none). On a CPU a
# stall bound of 500 ms keeps the unpaced throughput and first-token times at 8 and 32 clients and
# halves the worst gap between tokens; bounds in decode steps never let an int4 iteration past 64
# rows, so prompts trickle in (docs/benchmarks.md: pacing's frontier, `make bench-pacing`).
DEFAULT_PREFILL_SLOWDOWN = {"cuda": 0.0, "cpu": 0.0, "testbed": 0.0}
DEFAULT_PREFILL_STALL_MS = {"cuda": 0.0, "cpu": 500.0, "testbed": 500.0}
DEFAULT_KV_CACHE_MEMORY_GIB = 1.0
DEFAULT_CPU_KV_CACHE_MEMORY_GIB = 4.0
# What --memory-gib keeps back from the KV pool for activations, logits and scratch buffers.
ACTIVATION_RESERVE_GIB = 0.25
# The share of a CUDA device's total memory the engine takes where no budget says otherwise: the
# fit's GPU budget and the KV pool's default (engine/device/memory.py); vLLM's default too.
GPU_MEMORY_FRACTION = 0.9
_OF_THE_GPU = f"{GPU_MEMORY_FRACTION:.0%} of the device's total memory"


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: the block size and the sizes of its two pools, in blocks or in memory.

    The GPU pool is, first that is set: `num_blocks`; `kv_cache_memory_gib`; what
    `memory_gib` (weights and pool together) leaves once the weights are loaded, less
    ACTIVATION_RESERVE_GIB; DEFAULT_KV_CACHE_MEMORY_GIB. (On CUDA the engine budgets
    GPU_MEMORY_FRACTION of the device's memory when none is set.)"""

    block_size: int = knob("--block-size", 16, "tokens per KV block", Group.KV_CACHE)
    num_blocks: int | None = knob(  # None: sized by memory
        "--num-gpu-blocks", None, "GPU KV pool blocks (default: from --kv-cache-gib); caps it to emulate a small GPU",
        Group.MEMORY_OVERRIDES, deprecated=("--num-blocks",))
    kv_cache_memory_gib: float | None = knob(
        "--kv-cache-gib", None, f"GPU KV pool size (default: what --memory-gib leaves, else "
        f"{DEFAULT_KV_CACHE_MEMORY_GIB:g}; on cuda what {_OF_THE_GPU} leaves)", Group.MEMORY_OVERRIDES,
        deprecated_keywords=("kv_cache_memory_gib",))
    memory_gib: float | None = knob(
        "--memory-gib", None, "GPU memory for weights and KV pool together: the pool gets what the weights leave",
        Group.MEMORY_OVERRIDES)
    num_cpu_blocks: int | None = knob(  # None: from cpu_kv_cache_memory_gib
        "--num-cpu-blocks", None, "host KV pool blocks (default: --cpu-kv-cache-gib)", Group.MEMORY_OVERRIDES)
    # None: the fit sizes the host pool (DEFAULT_CPU_KV_CACHE_MEMORY_GIB, or from --host-memory-gib)
    cpu_kv_cache_memory_gib: float | None = knob(
        "--cpu-kv-cache-gib", None, f"host KV pool size (default: {DEFAULT_CPU_KV_CACHE_MEMORY_GIB:g}, or what "
        "--host-memory-gib leaves)", Group.MEMORY_OVERRIDES, deprecated_keywords=("cpu_kv_cache_memory_gib",))
    # Automatic prefix caching (scheduler/prefix_cache.py): full blocks a prompt shares with an
    # earlier one are taken from the cache instead of being computed again.
    enable_prefix_caching: bool = knob(
        "--prefix-caching", True, "reuse the KV of prompt prefixes seen before, in both KV pools "
        "(--no-prefix-caching: compute every prompt in full)", Group.KV_CACHE,
        deprecated_keywords=("enable_prefix_caching",))
    # How both pools store K/V (scheduler/planning/kv_format.py)
    kv_cache_dtype: str = knob(
        "--kv-cache-dtype", "auto", "how both KV pools store keys and values: auto (the compute dtype; int8 or int4 "
        "only where memory binds and the fit predicts a gain), a float dtype, int8 / int4 codes with a scale "
        "per 64 channels of a token (about 1.9x / 3.6x the sequences in the same memory), or k8v4: int8 keys and "
        "int4 values (about 2.5x)", Group.KV_CACHE,
        choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        parse_knobs(self)
        _require_int(self, "block_size", 1)
        _require_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        quantized_kv = self.kv_cache_dtype != "auto" and kv_format(self.kv_cache_dtype).quantized
        if quantized_kv and self.block_size % QUANTIZED_KV_BLOCK_MULTIPLE:
            raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype} needs block_size a multiple of "
                              f"{QUANTIZED_KV_BLOCK_MULTIPLE} (the kernels read whole vectors of tokens), "
                              f"got {self.block_size}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        _require_int(self, "num_blocks", 1, none_means="size the pool by memory")
        _require_int(self, "num_cpu_blocks", 1,
                     none_means="size the pool by cpu_kv_cache_gib; cpu_attention='off' drops the pool")
        for name in ("kv_cache_memory_gib", "memory_gib", "cpu_kv_cache_memory_gib"):
            if getattr(self, name) is not None:
                _require_positive(self, name)
        if self.kv_cache_memory_gib is not None and self.memory_gib is not None:
            raise ConfigError("give kv_cache_gib (the KV pool alone) or memory_gib (weights and KV pool "
                              "together), not both")

    @property
    def sized_by_memory_budget(self) -> bool:
        return self.num_blocks is None and self.kv_cache_memory_gib is None and self.memory_gib is not None

    def num_gpu_blocks_for(self, block_bytes: int) -> int:
        """The GPU pool's blocks of `block_bytes` each, when it does not depend on the
        weights (not sized_by_memory_budget): `num_blocks`, else what `kv_cache_memory_gib` holds."""
        if self.num_blocks is not None:
            return self.num_blocks
        return _blocks_in(self.kv_cache_memory_gib or DEFAULT_KV_CACHE_MEMORY_GIB, block_bytes)

    def num_gpu_blocks_after(self, weight_bytes: int, block_bytes: int, memory_gib: float,
                             activation_reserve_gib: float = ACTIVATION_RESERVE_GIB) -> int:
        """The pool's blocks when `memory_gib` holds the weights (`weight_bytes`), the activation
        reserve (the weight planner's estimate when it placed the weights) and the pool;
        ConfigError naming what to change when not even one block fits."""
        free_bytes = memory_gib * GIB_BYTES - weight_bytes - activation_reserve_gib * GIB_BYTES
        if free_bytes < block_bytes:
            raise ConfigError(
                f"memory_gib ({memory_gib:g}) leaves no room for the KV cache: the weights take "
                f"{weight_bytes / GIB_BYTES:.2f} GiB and activations {activation_reserve_gib:.2f} GiB; give more "
                f"memory, --quantization int4, a --weights-gpu-gib to stream layers, or a fixed --kv-cache-gib / "
                f"--num-gpu-blocks")
        return int(free_bytes // block_bytes)

    def num_cpu_blocks_for(self, block_bytes: int) -> int:
        """The host pool's blocks of `block_bytes` each: `num_cpu_blocks`, else what
        `cpu_kv_cache_memory_gib` holds (at least one)."""
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        return _blocks_in(self.cpu_kv_cache_memory_gib or DEFAULT_CPU_KV_CACHE_MEMORY_GIB, block_bytes)


@dataclass(frozen=True)
class CpuAttentionConfig:
    """Neo's CPU offloading: whether there is a host KV pool, the cores each side gets, and where
    the cost tables the scheduler plans with come from."""

    mode: CpuAttention = knob(
        "--cpu-attention", CpuAttention.AUTO, "Neo: some sequences' KV in a host pool and their decoding attention "
        "on the CPU; auto: on for testbed and cuda, chosen per iteration by the cost model; off: GPU-only",
        Group.DEVICE, deprecated=("--offload",))
    gpu_threads: int | None = knob(
        "--gpu-threads", None, "testbed: cores playing the GPU (default: planned from this machine's thread "
        "profile, LM-Offload's Algorithm 3)", Group.DEVICE, deprecated=("--accelerator-threads",))
    cpu_attention_threads: int | None = knob(
        "--cpu-attention-threads", None, "threads of the CPU side: decoding attention and CPU-computed MLP parts "
        "(default: planned; device cpu: 1)", Group.DEVICE)
    cost_tables: str | None = knob(  # None: profile once, cached
        "--cost-tables", None, "a JSON file of cost tables instead of this machine's profile", Group.DEVICE)
    profile_cache_dir: str | None = knob(
        "--profile-cache-dir", None, "where profiles are cached (default: profiles/ under $TANDEM_CACHE_DIR, "
        "else ~/.cache/tandem)", Group.DEVICE)
    profile_grid: str = "default"
    force_profile: bool = False  # measure again even if a cached profile exists

    def __post_init__(self) -> None:
        parse_knobs(self)
        _require_int(self, "gpu_threads", 1, none_means="half the testbed's cores")
        _require_int(self, "cpu_attention_threads", 1, none_means="the cores the GPU leaves")
        _require_choice(self, "profile_grid", PROFILE_GRIDS)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the model split over this many ranks, one Ray actor each
    (engine/distributed), on a local Ray cluster or the one at `ray_address`."""

    tensor_parallel_size: int = knob(
        "--tensor-parallel-size", 1, "split the model's heads, MLP units and LM head over this many ranks, one Ray "
        "actor each with its own GPU (one per rank on cuda) or its own share of the host's cores, and its own GPU "
        "and host KV pools", Group.PARALLEL, short="-tp")
    pipeline_parallel_size: int = knob(
        "--pipeline-parallel-size", 1, "cut the decoder layers into this many contiguous stages, one Ray actor "
        "each with its own layers, KV pools and share of the host's cores; a step's hidden states pass from stage "
        "to stage (one activation a step between stages, where tensor parallelism all-reduces twice a layer)",
        Group.PARALLEL, short="-pp")
    ray_address: str | None = knob(  # None: start a local cluster when the ranks are several
        "--ray-address", None, "the Ray cluster the ranks run on (default: a local one, started with the server)",
        Group.PARALLEL)

    def __post_init__(self) -> None:
        parse_knobs(self)
        _require_int(self, "tensor_parallel_size", 1)
        _require_int(self, "pipeline_parallel_size", 1)

    @property
    def enabled(self) -> bool:
        """Whether the model runs on ranks on Ray (tensor-parallel shards or pipeline stages)."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class WeightsConfig:
    """Where decoder layers' weights live (PIPO): resident on the GPU, or streamed into it
    from host memory or from per-layer files in `offload_dir`. The planner (scheduler/planning)
    decides per layer from these budgets and measured bandwidths; with placement `auto` and no
    `gpu_gib` every layer stays resident, as without this section."""

    placement: PlacementMode = knob(
        "--weight-placement", PlacementMode.AUTO, "auto: chosen per layer from the budgets and measured bandwidths; "
        "gpu: all resident; cpu: all streamed from host memory; disk: all streamed from --offload-dir", Group.WEIGHTS)
    gpu_gib: float | None = knob(
        "--weights-gpu-gib", None, "GPU memory for weights (embeddings, head, norms, resident layers and the "
        "buffers streamed layers pass through); layers beyond it stream", Group.MEMORY_OVERRIDES)
    host_gib: float | None = knob(  # None: what the host has
        "--weights-cpu-gib", None, "host memory for streamed layers (default: 80% of what the host has "
        "available); layers beyond it stream from --offload-dir", Group.MEMORY_OVERRIDES)
    offload_dir: str | None = knob(
        "--offload-dir", None, "where disk-placed layers' files live ('tandem convert' writes them; serve writes "
        "missing ones)", Group.WEIGHTS)
    pipeline: WeightPipeline = knob(
        "--weight-pipeline", WeightPipeline.AUTO, "performance: the next streamed layer preloads (one buffer "
        "more); memory: one buffer per layer in use; auto: by estimated throughput", Group.WEIGHTS)
    # None: planned (scheduler/planning/threads.py: on 2 cores 1 beat 4 by 1.15x)
    num_io_threads: int | None = knob(
        "--weight-io-threads", None, "disk reads in flight per layer load (default: planned)", Group.WEIGHTS)
    num_copy_threads: int | None = knob(  # None: planned (scheduler/planning/threads.py)
        "--weight-copy-threads", None, "threads of the host copy engine streamed layers pass through (default: "
        "planned)", Group.WEIGHTS)
    expected_context_len: int | None = knob(
        "--expected-context-len", None, "tokens per sequence the placement's throughput estimate assumes "
        "(default: max-model-len)", Group.WEIGHTS)
    # ScheInfer's MLP slicing (engine/offload/slicing/sliced_mlp.py); from Python also SliceRates
    # for every layer or one per layer
    mlp_slicing: MlpSlicing = knob(
        "--mlp-slicing", MlpSlicing(), "ScheInfer's MLP slicing: off; auto (rates solved within --weights-gpu-gib "
        "for decode batches of --max-num-seqs); or CC,CG: the fractions of each layer's MLP (of a MoE layer's "
        "experts, whole) computed on the CPU and streamed to the GPU (the rest resident), e.g. 0.25,0.5",
        Group.WEIGHTS, metavar="off|auto|CC,CG", parse=MlpSlicing.parse)
    # ScheInfer's prefill token assignment (sec. IV-B); off for ablations
    mlp_prefill_moving: Switch = knob(
        "--mlp-prefill-moving", Switch.ON, "under --mlp-slicing, ScheInfer's prefill token assignment: each forward "
        "moves the tokens the slicing models say to the GPU with CC's weights copied over (CG'); off: the CPU "
        "computes its slices for every token", Group.WEIGHTS)
    # The hot-expert cache of a MoE model (engine/offload/experts/cache.py)
    hot_experts: HotExperts | int = knob(
        "--hot-experts", HotExperts.AUTO, "a MoE model's hot-expert cache: auto (where the experts do not fit "
        "--weights-gpu-gib, each routed layer keeps as many of its most-routed experts on the GPU as the budget "
        "leaves; the CPU computes the rest); off; or N experts per layer", Group.WEIGHTS, metavar="auto|off|N",
        parse=parse_hot_experts)
    expert_window_tokens: int = knob(
        "--expert-window-tokens", DEFAULT_WINDOW_TOKENS, "the routed tokens per layer whose expert counts choose "
        "the hot experts (a sliding window: the hot set follows a shift in popularity within about this many "
        "tokens)", Group.WEIGHTS)

    def __post_init__(self) -> None:
        parse_knobs(self)
        _require_int(self, "expert_window_tokens", NUM_WINDOW_BUCKETS)
        for name in ("gpu_gib", "host_gib"):
            if getattr(self, name) is not None:
                _require_positive(self, name)
        _require_int(self, "num_io_threads", 1, none_means="planned")
        _require_int(self, "num_copy_threads", 1, none_means="planned")
        _require_int(self, "expected_context_len", 1, none_means="max_model_len")
        if self.placement == PlacementMode.DISK and not self.offload_dir:
            raise ConfigError("weight_placement disk streams every layer from files in offload_dir; give "
                              "--offload-dir")
        if self.offload_dir is not None and (not isinstance(self.offload_dir, str) or not self.offload_dir):
            raise ConfigError(f"offload_dir must be a directory path, got {self.offload_dir!r}")

    def slice_rates(self, num_layers: int) -> tuple[SliceRates, ...] | None:
        """Each of `num_layers` layers' MLP slice rates, or None when slicing is off or solved at
        start (`slicing_solved`)."""
        try:
            return self.mlp_slicing.layer_rates(num_layers)
        except ValueError as exc:
            raise ConfigError(f"mlp_slicing {exc}") from None

    @property
    def slicing_solved(self) -> bool:
        """--mlp-slicing auto: the engine solves each layer's rates at start (ScheInfer sec. IV-A)."""
        return self.mlp_slicing.solved

    @property
    def prefill_moving(self) -> bool:
        return self.mlp_prefill_moving == Switch.ON

    @property
    def hot_expert_slots(self) -> int | None:
        """--hot-experts as a number of slots per routed layer; None for auto and off."""
        return None if isinstance(self.hot_experts, HotExperts) else self.hot_experts

    @property
    def hot_experts_off(self) -> bool:
        return self.hot_experts == HotExperts.OFF

    @property
    def streaming_requested(self) -> bool:
        """Whether the planner places layers: a placement other than auto, or a weight budget."""
        return self.placement != PlacementMode.AUTO or self.gpu_gib is not None


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from: the top-level fields below and five sections.
    Users pass flat keywords through `from_flat`.

    `decode_attention` names an entry of a registry that can grow (engine.attention), so that
    registry checks it as the engine starts."""

    model: str = knob("--model", "smollm2-135m", "a GGUF file, an HF safetensors directory, or a preset name "
                      "(with --load-format dummy)", Group.MODEL)
    load_format: LoadFormat = knob("--load-format", LoadFormat.AUTO, "auto: from --model (a .gguf file, a "
                                   "directory, a preset)", Group.MODEL)
    # auto: measured as the engine starts; also the short names (fp32, ...)
    dtype: str = knob("--dtype", "auto", "auto (measured), float32, bfloat16 or float16", Group.MODEL)
    quantization: Quantization = knob(
        "--quantization", Quantization.AUTO, "decoder-layer weights: auto (a GGUF's 4-bit blocks stay packed; "
        "16-bit weights become int4 only where memory binds and the fit predicts a gain), none (dense in --dtype), "
        "int4 (packed; round-to-nearest in groups of 32 where not stored so; devices cpu and cuda)", Group.MODEL)
    int4_prefill: Int4Prefill = knob(
        "--int4-prefill", Int4Prefill.DEQUANTIZE, "how INT4 weights on device cpu multiply prefill chunks of more "
        "than 64 tokens: dequantize (into a scratch buffer for torch's GEMM; the tokens of any batching) or int8 "
        "(activations to int8 blocks and integer dot products, llama.cpp's scheme: about as fast as dense bf16, "
        "perplexity +0.3%, and a prompt's tokens then depend on how it was chunked) or int16 (decode's own kernel "
        "at every row count, as --batch-invariant uses it: a row's numbers whatever its chunk, slower on long "
        "prompts)", Group.MODEL)
    batch_invariant: bool = knob(
        "--batch-invariant", False, "on device cpu, a token's numbers do not depend on what it is computed with: "
        "a prompt's rows go through decode's kernels (INT4 x as int16, the dense GEMV, attention row by row over "
        "the KV blocks from position 0), so greedy text is the same with prefix caching on or off, chunked or "
        "not, alone or beside other requests; prefill is slower (docs/benchmarks.md)", Group.MODEL)
    cpu_ops: CpuOps = knob(
        "--cpu-ops", CpuOps.LAYERS, "how the decoder layers run on a CPU device: layers (a decode batch's layers in "
        "one C++ call), fused (op by op, RMSNorm, RoPE and SiLU*up as C++ kernels), torch (torch ops)", Group.MODEL)
    # On CUDA, GPU-only decode steps replay CUDA graphs (engine/runtime/cuda_graphs.py)
    enforce_eager: bool = knob("--enforce-eager", False, "on CUDA, run every decode step op by op instead of "
                               "replaying CUDA graphs of it", Group.MODEL)
    seed: int = knob("--seed", 0, "dummy weights and unseeded requests' sampling", Group.MODEL)
    device: str = knob(
        "--device", "cpu", "the GPU: cpu (the CPU plays both roles), testbed (a GPU thread on its own cores beside "
        "the CPU attention: Neo's overlap on a CPU-only host), cuda[:N]", Group.DEVICE)
    max_model_len: int | None = knob(
        "--max-model-len", None, "context length (default: the model's, capped by the engine and the KV cache)",
        Group.BATCHING)
    max_num_seqs: int = knob("--max-num-seqs", 64, "sequences running at once", Group.BATCHING)
    max_num_batched_tokens: int | None = knob(  # None: the device's default (DEFAULT_BATCHED_TOKENS)
        "--max-num-batched-tokens", None, "tokens in one iteration; longer prompts are prefilled in chunks "
        f"(default: {DEFAULT_BATCHED_TOKENS['cuda']})", Group.BATCHING)
    # scheduler/prefill_pacing.py; None: the device's default (DEFAULT_PREFILL_SLOWDOWN)
    max_prefill_slowdown: float | None = knob(
        "--max-prefill-slowdown", None, "while streams decode, an iteration carrying prompt chunks takes at most "
        "this many decode steps' time, so running streams keep their pace (0: no such bound; by default none: "
        "--max-prefill-stall-ms bounds it)", Group.BATCHING)
    max_prefill_stall_ms: float | None = knob(
        "--max-prefill-stall-ms", None, "while streams decode, an iteration carrying prompt chunks takes at most "
        "this many milliseconds longer than a decode step (0: no such bound; default "
        f"{DEFAULT_PREFILL_STALL_MS['cpu']:g} on cpu and testbed, {DEFAULT_PREFILL_STALL_MS['cuda']:g} on cuda; with "
        "--max-prefill-slowdown the smaller allowance holds, and either flag alone turns the other's default off)",
        Group.BATCHING)
    # Speculative decoding (engine/speculative): vLLM's flag, its JSON keys
    speculative_config: SpeculativeConfig | None = knob(
        "--speculative-config", None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": '
        'K, "prompt_lookup_min": A, "prompt_lookup_max": B} drafts up to K tokens from the latest earlier match of '
        'the last A..B tokens (defaults 2..4) in the prompt and output, and one forward verifies them (greedy text '
        'and sampled distributions as without it)', Group.BATCHING, metavar="JSON", parse=SpeculativeConfig.parse)
    # The fit's two budgets (engine/planning/fit.py)
    gpu_memory_gib: float | None = knob(
        "--gpu-memory-gib", None, "the GPU's memory for weights, layer buffers, activations and its KV pool "
        f"(default: cuda {_OF_THE_GPU}; cpu and testbed, the host's memory)", Group.MEMORY)
    host_memory_gib: float | None = knob(
        "--host-memory-gib", None, "host memory for streamed layers and the host KV pool (default: 80% of what "
        "the host has available)", Group.MEMORY)
    ttft_target_s: float | None = knob(
        "--ttft-target-s", None, "the time to first token the fit plans for: among the formats and placements it "
        "weighs, those predicted to prefill an --expected-context-len prompt within this many seconds come first, "
        "the fastest decode among them is taken, and the plan says when none does (default: no bound)", Group.MEMORY)
    decode_attention: str = "auto"  # auto | cpu (C++ kernel) | torch (reference)
    show_progress: bool = False  # progress bars while the weights load and the costs are profiled
    cache: CacheConfig = field(default_factory=CacheConfig)
    cpu_attention: CpuAttentionConfig = field(default_factory=CpuAttentionConfig)
    neo: NeoKnobs = field(default_factory=NeoKnobs)  # scheduler/neo.py says why each default
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        parse_knobs(self)
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not _DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, testbed, cuda or cuda:<index>, got {self.device!r}")
        _require_int(self, "seed", 0)
        _require_int(self, "max_model_len", 1, none_means="the model's context length, capped")
        _require_int(self, "max_num_seqs", 1)
        _require_int(self, "max_num_batched_tokens", 1, none_means="the device's default")
        slowdown = self.max_prefill_slowdown
        if slowdown is not None and (not isinstance(slowdown, (int, float)) or isinstance(slowdown, bool)
                                     or not (slowdown == 0 or slowdown > 1)):
            raise ConfigError(f"max_prefill_slowdown must be 0 (off) or a number > 1, got {slowdown!r}")
        stall = self.max_prefill_stall_ms
        if stall is not None and (not isinstance(stall, (int, float)) or isinstance(stall, bool) or not stall >= 0):
            raise ConfigError(f"max_prefill_stall_ms must be 0 (off) or a number of milliseconds > 0, got {stall!r}")
        for name in ("gpu_memory_gib", "host_memory_gib", "ttft_target_s"):
            if getattr(self, name) is not None:
                _require_positive(self, name)
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.quantization == Quantization.INT4 and self.device == "testbed":
            raise ConfigError("quantization int4 runs on device cpu or cuda, not on the testbed: its GPU "
                              "thread would share the CPU kernels' thread pool with the CPU attention; use "
                              "--quantization none there")
        self._check_batch_invariant()
        if self.int4_prefill != Int4Prefill.DEQUANTIZE and self.device != "cpu":
            raise ConfigError(f"int4_prefill {self.int4_prefill} runs on device cpu (the CPU's INT4 kernels), not on "
                              f"{self.device}; leave --int4-prefill at dequantize there")
        for section, config_type in _SECTIONS.items():  # a flat value here would fail much later
            value = getattr(self, section)
            if not isinstance(value, config_type):
                raise ConfigError(f"{section} must be of type {config_type.__name__}, got {value!r}; "
                                  f"flat keywords go through EngineConfig.from_flat")
        self._check_parallel()

    def _check_batch_invariant(self) -> None:
        """Batch invariance holds where every kernel of a forward is the CPU's own, one order per row."""
        if not self.batch_invariant:
            return
        if self.device != "cpu":
            raise ConfigError(f"batch_invariant runs on device cpu (its kernels keep one order per row), not on "
                              f"{self.device}; drop --batch-invariant there")
        if self.int4_prefill == Int4Prefill.INT8:
            raise ConfigError("batch_invariant multiplies every chunk with decode's int16 kernel; drop "
                              "--int4-prefill int8")
        if self.cpu_attention_enabled:  # Neo's host pool splits a sequence's attention over threads
            raise ConfigError("batch_invariant keeps every sequence's attention on one thread; drop "
                              "--cpu-attention on")

    def _check_parallel(self) -> None:
        """What tensor and pipeline parallelism do not combine with yet, refused with the flag to
        change: the fit's budgets (disk-tier layers, chosen or asked for, the engine refuses once
        planned); Neo's host pool in pipeline stages."""
        stages = self.parallel.pipeline_parallel_size
        if stages > 1 and self.cpu_attention_enabled:
            raise ConfigError(f"--pipeline-parallel-size {stages}: CPU attention (Neo) in pipeline stages is not "
                              f"built yet; use --cpu-attention off or --pipeline-parallel-size 1")
        if self.parallel.enabled and (self.gpu_memory_gib is not None or self.host_memory_gib is not None):
            parallel = self.parallel
            flag = (f"--tensor-parallel-size {parallel.tensor_parallel_size}" if parallel.tensor_parallel_size > 1
                    else f"--pipeline-parallel-size {parallel.pipeline_parallel_size}")
            raise ConfigError(f"{flag} does not combine with "
                              f"--gpu-memory-gib / --host-memory-gib (the fit's budgets) yet: place each rank's "
                              f"layers with --weights-gpu-gib / --weights-cpu-gib and size its pools with "
                              f"--kv-cache-gib / --cpu-kv-cache-gib, or use one rank")

    @property
    def torch_device(self) -> str:
        """Where the model's tensors live: the testbed's GPU is a thread on the host."""
        return "cpu" if self.device == "testbed" else self.device

    @property
    def batched_tokens_budget(self) -> int:
        """Tokens one iteration computes (chunked prefill): `max_num_batched_tokens`, else the
        device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS["cuda" if self.device.startswith("cuda") else self.device]

    @property
    def prefill_slowdown_limit(self) -> float:
        """`max_prefill_slowdown`; else none where `max_prefill_stall_ms` is given, else the device's
        default (DEFAULT_PREFILL_SLOWDOWN)."""
        if self.max_prefill_slowdown is not None:
            return float(self.max_prefill_slowdown)
        if self.max_prefill_stall_ms is not None:
            return 0.0
        return DEFAULT_PREFILL_SLOWDOWN["cuda" if self.device.startswith("cuda") else self.device]

    @property
    def prefill_stall_limit_s(self) -> float:
        """`max_prefill_stall_ms` in seconds; else none where `max_prefill_slowdown` is given, else
        the device's default (DEFAULT_PREFILL_STALL_MS)."""
        if self.max_prefill_stall_ms is not None:
            return self.max_prefill_stall_ms / 1000
        if self.max_prefill_slowdown is not None:
            return 0.0
        return DEFAULT_PREFILL_STALL_MS["cuda" if self.device.startswith("cuda") else self.device] / 1000

    @property
    def cpu_attention_enabled(self) -> bool:
        """Whether the engine keeps a host KV pool and plans with the Neo scheduler."""
        if self.cpu_attention.mode == CpuAttention.AUTO:  # not in pipeline stages (not built there)
            return (self.device == "testbed" or self.device.startswith("cuda")) and \
                self.parallel.pipeline_parallel_size == 1
        return self.cpu_attention.mode == CpuAttention.ON

    @classmethod
    def from_flat(cls, **kwargs: Any) -> "EngineConfig":
        """Route flat keywords to their fields (FLAT_NAMES: `block_size` to `cache.block_size`,
        `cpu_attention` to `cpu_attention.mode`, `swap_cooldown_iterations` to `neo`, ...); an
        unknown keyword raises TypeError naming it and listing the known ones."""
        kwargs = _renamed_flat_names(kwargs)
        unknown = sorted(set(kwargs) - set(FLAT_NAMES))
        if unknown:
            raise TypeError(f"unknown engine arguments {unknown}; known: {sorted(FLAT_NAMES)}")
        values: dict[tuple[str, ...], dict[str, Any]] = {(): {}, **{(section,): {} for section in _SECTIONS}}
        for name, value in kwargs.items():
            *section, field_name = FLAT_NAMES[name]
            values[tuple(section)][field_name] = value
        built = {section: config_type(**values[(section,)]) for section, config_type in _SECTIONS.items()}
        return cls(**values[()], **built)


_SECTIONS = sections(EngineConfig)
# Every knob a user sets, in declaration order: each with its flag, help, group and field.
ENGINE_KNOBS = config_knobs(EngineConfig)
# Every keyword from_flat takes -> the path of its field: a knob's flag name with underscores, and
# the field's own name where it has no flag (NeoKnobs, decode_attention, ...).
FLAT_NAMES = flat_names(EngineConfig)
# Former keywords -> the keywords now: the former flags' names (--offload: offload) and the former
# field-named keywords (kv_cache_memory_gib); from_flat takes them with a warning.
DEPRECATED_FLAT_NAMES = {former: knob.keyword for knob in ENGINE_KNOBS for former in knob.former_keywords}


def _renamed_flat_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with each deprecated flat keyword under its name now, warning once per keyword."""
    renamed = dict(kwargs)
    for old, new in DEPRECATED_FLAT_NAMES.items():
        if old in renamed and old not in FLAT_NAMES:
            if new in renamed:
                raise TypeError(f"give {new} or its deprecated name {old}, not both")
            log.warning("engine argument %s is deprecated: use %s", old, new)
            renamed[new] = renamed.pop(old)
    return renamed
