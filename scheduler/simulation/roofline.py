"""Roofline cost model: Neo's stage times derived from a hardware profile, for the simulator.

A stage takes as long as the slower of its two roofs, moving its bytes at the memory's achievable
bandwidth or doing its FLOPs at the achievable FLOP rate, plus a small fixed cost per launch:

    linear(n)              one layer's weights read once, 2 * params * n FLOPs     (GPU)
    prefill_attention      causal QK^T and AV FLOPs of each prompt                 (GPU)
    gpu_decode_attention   the KV of every context token read once                 (GPU)
    cpu_decode_attention   the same KV read from host DRAM, Q/K/V and output over PCIe (CPU)
    head                   the LM head matmul on the sampled rows                  (GPU)
    swap                   whole KV blocks over PCIe                               (PCIe)

Tensor parallelism (Neo ran Llama-3.1-70B on two H100s) splits weights, FLOPs and KV heads over
`num_gpus`, and each layer then pays two all-reduces of the activations over the GPU interconnect.
The host side is not multiplied: every rank's CPU attention shares the one NUMA node's memory.

A `HardwareProfile` is loaded from `configs/hardware/<name>.json`: datasheet peaks, the fraction of
each peak that real kernels reach, and a note on the source of every number. `size_pools` turns a
profile and a model into the GPU and host KV pool sizes the simulator runs with. No torch here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from scheduler.planning.cost_model import CostModel, ModelShape, kv_bytes_per_token

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"

GIB = 1 << 30
GB = 1e9  # datasheets quote bandwidths in decimal GB/s
TERA = 1e12

# ---- fixed costs the roofs do not see ------------------------------------------------------
# One layer's linear stage launches about eight kernels (norm, QKV GEMM, RoPE, O GEMM, residual +
# norm, gate/up GEMM, activation, down GEMM); a launch costs a few microseconds of host time that
# a small batch cannot hide behind the GPU's work.
LINEAR_LAUNCH_OVERHEAD_S = 20e-6
# One attention kernel launch (prefill or paged decode), per layer.
ATTENTION_LAUNCH_OVERHEAD_S = 5e-6
# The LM head: final norm, one GEMM, the sampler's kernels; once per iteration.
HEAD_LAUNCH_OVERHEAD_S = 20e-6
# One CPU attention call per layer and sub-batch wakes the kernel's worker threads and joins them.
CPU_ATTENTION_CALL_OVERHEAD_S = 20e-6
# Per sequence, the CPU kernel sets up its tasks and merges the partial softmax of each split.
CPU_ATTENTION_PER_SEQ_OVERHEAD_S = 1e-6
# Fixed cost of one host<->device copy (driver call, DMA setup); a CPU attention call makes two
# per layer: Q/K/V of the batch down to the host, the attention output back up.
PCIE_COPY_LATENCY_S = 10e-6
# One small NCCL all-reduce over NVLink; tensor parallelism pays two per layer.
ALLREDUCE_LATENCY_S = 10e-6
NUM_ALLREDUCES_PER_LAYER = 2  # after the O projection and after the MLP's down projection

# ---- pool sizing -----------------------------------------------------------------------------
# Share of GPU memory the engine may take (vLLM's default `gpu_memory_utilization`): the rest is
# the CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation.
GPU_MEMORY_UTILIZATION = 0.9
# Share of host memory given to the pinned KV pool. Page-locked memory cannot be swapped or
# reclaimed, and the host still needs room for the OS, the server and the weights' file pages
# while loading; Neo's own T4 setup asks for 30 GB of CPU KV on its 64 GB g4dn host.
HOST_KV_FRACTION = 0.5
# The sampler keeps fp32 logits of every row it samples.
LOGITS_BYTES = 4


class HardwareProfileError(ValueError):
    """A hardware profile that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU server as the roofline model sees it. GPU numbers are per GPU; host numbers are
    what the engine's share of the host offers. Bandwidths in GB/s (1e9 bytes/s), memory in GiB."""

    name: str
    gpu_name: str
    num_gpus: int  # tensor-parallel degree
    gpu_memory_gib: float
    gpu_memory_bandwidth_gbps: float
    gpu_tflops: float  # dense fp16/bf16 tensor-core peak
    pcie_gbps: float  # host<->device, one direction, effective (pinned copies)
    interconnect_gbps: float  # GPU<->GPU, one direction (NVLink); 0 with one GPU
    cpu_name: str
    num_cpu_cores: int  # physical cores
    host_memory_gib: float
    host_memory_bandwidth_gbps: float
    host_tflops: float  # fp32 vector peak of those cores: the CPU kernel accumulates in fp32
    # fractions of the peaks above that real kernels reach (each profile says why its values)
    gpu_bandwidth_efficiency: float
    gpu_flops_efficiency: float
    host_bandwidth_efficiency: float
    host_flops_efficiency: float
    notes: Mapping[str, str] = field(compare=False)  # field name -> where its value comes from

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise HardwareProfileError(f"hardware profile {self.name!r}: {name} {message}")

        for name in ("name", "gpu_name", "cpu_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                fail(name, f"must be a non-empty string, got {value!r}")
        for name in ("num_gpus", "num_cpu_cores"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(name, f"must be an integer >= 1, got {value!r}")
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not _number(value) or value <= 0:
                fail(name, f"must be a number > 0, got {value!r}")
        for name in _EFFICIENCY_FIELDS:
            value = getattr(self, name)
            if not _number(value) or not 0 < value <= 1:
                fail(name, f"is a fraction of a peak and must be in (0, 1], got {value!r}")
        if not _number(self.interconnect_gbps) or self.interconnect_gbps < 0:
            fail("interconnect_gbps", f"must be a number >= 0, got {self.interconnect_gbps!r}")
        if self.num_gpus > 1 and self.interconnect_gbps == 0:
            fail("interconnect_gbps", f"must be > 0 with {self.num_gpus} GPUs (tensor parallelism all-reduces)")
        if not isinstance(self.notes, Mapping) or not all(isinstance(v, str) and v.strip()
                                                          for v in self.notes.values()):
            fail("notes", "must map field names to non-empty strings")
        unknown = sorted(set(self.notes) - set(_NOTED_FIELDS))
        if unknown:
            fail("notes", f"name unknown fields {unknown}")
        missing = [name for name in _NOTED_FIELDS if name not in self.notes]
        if missing:
            fail("notes", f"must say where each number comes from; missing {missing}")

    # ---- achievable rates (bytes/s, FLOP/s), per GPU where a GPU number ----------------------
    @property
    def gpu_bandwidth(self) -> float:
        return self.gpu_memory_bandwidth_gbps * GB * self.gpu_bandwidth_efficiency

    @property
    def gpu_flops(self) -> float:
        return self.gpu_tflops * TERA * self.gpu_flops_efficiency

    @property
    def host_bandwidth(self) -> float:
        return self.host_memory_bandwidth_gbps * GB * self.host_bandwidth_efficiency

    @property
    def host_flops(self) -> float:
        return self.host_tflops * TERA * self.host_flops_efficiency

    @property
    def pcie_bandwidth(self) -> float:
        return self.pcie_gbps * GB

    @property
    def interconnect_bandwidth(self) -> float:
        return self.interconnect_gbps * GB

    # ---- files ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> "HardwareProfile":
        if not isinstance(data, Mapping):
            raise HardwareProfileError(f"{source}: a hardware profile is a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = [name for name in names if name not in data]
        if unknown or missing:
            raise HardwareProfileError(f"{source}: unknown fields {unknown}, missing fields {missing}")
        values = dict(data)
        for name in _POSITIVE_FIELDS + _EFFICIENCY_FIELDS + ("interconnect_gbps",):
            if isinstance(values[name], int) and not isinstance(values[name], bool):
                values[name] = float(values[name])  # JSON writes 64.0 as 64
        try:
            return cls(**values)
        except HardwareProfileError as exc:
            raise HardwareProfileError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, name_or_path: str | Path) -> "HardwareProfile":
        """A profile by name (`configs/hardware/<name>.json`) or by path to a JSON file."""
        path = Path(name_or_path)
        if path.suffix != ".json":
            path = HARDWARE_DIR / f"{name_or_path}.json"
            if not path.is_file():
                raise HardwareProfileError(f"unknown hardware profile {str(name_or_path)!r}; "
                                           f"known: {list_hardware_profiles()}")
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise HardwareProfileError(f"{path}: cannot read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise HardwareProfileError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))


_POSITIVE_FIELDS = ("gpu_memory_gib", "gpu_memory_bandwidth_gbps", "gpu_tflops", "pcie_gbps",
                    "host_memory_gib", "host_memory_bandwidth_gbps", "host_tflops")
_EFFICIENCY_FIELDS = ("gpu_bandwidth_efficiency", "gpu_flops_efficiency", "host_bandwidth_efficiency",
                      "host_flops_efficiency")
# every number and part name needs its source
_NOTED_FIELDS = ("gpu_name", "num_gpus", "cpu_name", "num_cpu_cores", "interconnect_gbps",
                 *_POSITIVE_FIELDS, *_EFFICIENCY_FIELDS)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def list_hardware_profiles() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


# ---- the cost model ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RooflineCostModel(CostModel):
    """Neo's per-layer stage times from a model shape and a hardware profile (see the module
    docstring). `dtype_bytes` is the size of one weight and one KV element (2 for fp16/bf16)."""

    shape: ModelShape
    hardware: HardwareProfile
    dtype_bytes: int = 2
    block_size: int = 16  # tokens per KV block, for `swap`
    # bytes of one stored KV element (a KVFormat's, scales included: int8 KV is read and moved in
    # about half the bytes); None: dtype_bytes
    kv_element_bytes: float | None = None
    # bytes of one stored linear weight (INT4's codes with their scales and mins); None: dtype_bytes
    weight_element_bytes: float | None = None

    def __post_init__(self) -> None:
        for name in ("dtype_bytes", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        shape, hw, size = self.shape, self.hardware, self.dtype_bytes
        weight_size = self.weight_element_bytes or size
        num_gpus = hw.num_gpus
        kv_bytes = shape.kv_bytes_per_token_layer(self.kv_element_bytes or size)
        q_width = shape.num_heads * shape.head_dim
        kv_width = shape.num_kv_heads * shape.head_dim
        derived = {
            # linear: the layer's weights, read once per batch, shared by the GPUs (every expert of
            # a MoE layer: an upper bound for batches too small to route to all of them); the
            # FLOPs are those of the weights each token uses
            "_linear_memory_s": shape.layer_params * weight_size / (num_gpus * hw.gpu_bandwidth),
            "_linear_s_per_token": 2 * shape.active_layer_params / (num_gpus * hw.gpu_flops),
            # a ring all-reduce sends 2 (g - 1) / g of the message from each GPU
            "_allreduce_s_per_token": (NUM_ALLREDUCES_PER_LAYER * 2 * (num_gpus - 1) / num_gpus
                                       * shape.hidden_size * size / hw.interconnect_bandwidth
                                       if num_gpus > 1 else 0.0),
            "_allreduce_fixed_s": NUM_ALLREDUCES_PER_LAYER * ALLREDUCE_LATENCY_S if num_gpus > 1 else 0.0,
            # causal prefill: QK^T and AV each 2 * head_dim FLOPs per (query, key) pair and head,
            # over n^2 / 2 pairs
            "_prefill_s_per_token_squared": 2 * shape.num_heads * shape.head_dim / (num_gpus * hw.gpu_flops),
            # prefill reads Q, K, V and writes the output once (the KV re-reads stay in SRAM)
            "_prefill_memory_s_per_token": (2 * q_width + 2 * kv_width) * size / (num_gpus * hw.gpu_bandwidth),
            "_gpu_decode_s_per_token": kv_bytes / (num_gpus * hw.gpu_bandwidth),
            # CPU decode: every rank's KV shard is read from the same NUMA node's DRAM; each KV
            # element meets num_heads / num_kv_heads queries, 2 FLOPs each in QK^T and in AV
            "_cpu_memory_s_per_token": kv_bytes / hw.host_bandwidth,
            "_cpu_compute_s_per_token": 4 * shape.num_heads * shape.head_dim / hw.host_flops,
            # Q, K, V of the new token down to the host and the output back up; the two directions
            # overlap, each GPU moves its own heads
            "_cpu_transfer_s_per_seq": (max(q_width + 2 * kv_width, q_width) * size
                                        / (num_gpus * hw.pcie_bandwidth)),
            "_head_memory_s": shape.vocab_size * shape.hidden_size * weight_size / (num_gpus * hw.gpu_bandwidth),
            "_head_s_per_row": 2 * shape.vocab_size * shape.hidden_size / (num_gpus * hw.gpu_flops),
            "_swap_s_per_block": (self.block_size * shape.num_layers * kv_bytes
                                  / (num_gpus * hw.pcie_bandwidth)),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def num_layers(self) -> int:  # type: ignore[override]
        return self.shape.num_layers

    def linear(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return (LINEAR_LAUNCH_OVERHEAD_S + max(self._linear_memory_s, self._linear_s_per_token * num_tokens)
                + self._allreduce_fixed_s + self._allreduce_s_per_token * num_tokens)

    def prefill_attention(self, seq_lens: Sequence[int]) -> float:
        total = 0.0
        for n in seq_lens:
            if n > 0:
                total += ATTENTION_LAUNCH_OVERHEAD_S + max(self._prefill_s_per_token_squared * n * n,
                                                           self._prefill_memory_s_per_token * n)
        return total

    def gpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        if num_seqs <= 0:
            return 0.0
        return ATTENTION_LAUNCH_OVERHEAD_S + self._gpu_decode_s_per_token * context_tokens

    def cpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        if num_seqs <= 0:
            return 0.0
        per_token = max(self._cpu_memory_s_per_token, self._cpu_compute_s_per_token)
        return (CPU_ATTENTION_CALL_OVERHEAD_S + 2 * PCIE_COPY_LATENCY_S
                + num_seqs * (CPU_ATTENTION_PER_SEQ_OVERHEAD_S + self._cpu_transfer_s_per_seq)
                + per_token * context_tokens)

    def head(self, num_seqs: int) -> float:
        if num_seqs <= 0:
            return 0.0
        return HEAD_LAUNCH_OVERHEAD_S + max(self._head_memory_s, self._head_s_per_row * num_seqs)

    def swap(self, num_blocks: int) -> float:
        return self._swap_s_per_block * max(num_blocks, 0)

    # ---- regimes, for reports and tests ------------------------------------------------------------
    @property
    def linear_ridge_tokens(self) -> float:
        """Batch tokens at which one layer's linear work turns from weight-bandwidth-bound into
        FLOP-bound: below it, more tokens ride along almost for free."""
        return self._linear_memory_s / self._linear_s_per_token

    @property
    def cpu_attention_memory_bound(self) -> bool:
        """Whether the host's DRAM, not its arithmetic, limits CPU decoding attention."""
        return self._cpu_memory_s_per_token >= self._cpu_compute_s_per_token


# ---- pool sizing ---------------------------------------------------------------------------------
class PoolSizingError(ValueError):
    """The model does not leave room for a KV cache on this hardware."""


@dataclass(frozen=True)
class PoolSizes:
    """KV pool sizes for one model on one machine, and the memory budget behind them (all GPUs)."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int  # K and V of `block_size` tokens in every layer
    weight_gib: float
    activation_gib: float
    gpu_kv_gib: float
    cpu_kv_gib: float


def weight_bytes(shape: ModelShape, dtype_bytes: int, linear_element_bytes: float | None = None) -> int:
    """All weights: the layers, the embedding and the LM head (counted apart: an untied model's
    head is its own matrix, and a tied one is over-counted by one matrix, erring to fewer blocks),
    and the norms. `linear_element_bytes`: the layers' linear weights and the head as stored (None:
    dtype_bytes); the embedding and norms stay in the compute dtype."""
    linear = shape.num_layers * shape.layer_params + shape.vocab_size * shape.hidden_size
    dense = shape.num_layers * 2 * shape.hidden_size + shape.vocab_size * shape.hidden_size + shape.hidden_size
    return round(linear * (linear_element_bytes or dtype_bytes) + dense * dtype_bytes)


def activation_bytes_per_gpu(shape: ModelShape, num_gpus: int, dtype_bytes: int, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """Peak activations of one forward at the token budget, on one GPU: the residual stream and
    its normed copy (replicated under tensor parallelism), this rank's Q/K/V and attention output,
    the MLP's gate and up outputs; plus fp32 logits of this rank's vocabulary shard for every row."""
    q_width = shape.num_heads * shape.head_dim
    kv_width = shape.num_kv_heads * shape.head_dim
    per_token = 2 * shape.hidden_size + (2 * q_width + 2 * kv_width + 2 * shape.intermediate_size) / num_gpus
    return int(max_num_batched_tokens * per_token * dtype_bytes
               + max_num_seqs * shape.vocab_size / num_gpus * LOGITS_BYTES)


def size_pools(shape: ModelShape, hardware: HardwareProfile, *, dtype_bytes: int = 2, block_size: int = 16,
               max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
               kv_element_bytes: float | None = None, weight_element_bytes: float | None = None) -> PoolSizes:
    """GPU blocks: what `GPU_MEMORY_UTILIZATION` of each GPU leaves after its weight shard and its
    activations; host blocks: `HOST_KV_FRACTION` of host memory."""
    num_gpus = hardware.num_gpus
    block_bytes = block_size * kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                                  kv_element_bytes or dtype_bytes)
    weights = weight_bytes(shape, dtype_bytes, weight_element_bytes)
    activations = num_gpus * activation_bytes_per_gpu(shape, num_gpus, dtype_bytes, max_num_batched_tokens,
                                                      max_num_seqs)
    usable = num_gpus * hardware.gpu_memory_gib * GIB * GPU_MEMORY_UTILIZATION
    gpu_kv = usable - weights - activations
    if gpu_kv < block_bytes:
        raise PoolSizingError(
            f"{hardware.name}: {weights / GIB:.1f} GiB of weights and {activations / GIB:.2f} GiB of activations "
            f"leave no KV cache in {GPU_MEMORY_UTILIZATION:.0%} of {num_gpus} x {hardware.gpu_memory_gib} GiB")
    cpu_kv = hardware.host_memory_gib * GIB * HOST_KV_FRACTION
    return PoolSizes(
        num_gpu_blocks=int(gpu_kv // block_bytes),
        num_cpu_blocks=int(cpu_kv // block_bytes),
        block_bytes=block_bytes,
        weight_gib=weights / GIB,
        activation_gib=activations / GIB,
        gpu_kv_gib=gpu_kv / GIB,
        cpu_kv_gib=cpu_kv / GIB,
    )
