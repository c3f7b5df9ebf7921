"""Where each decoder layer's weights live, and which pipeline streams them (PIPO sec. 3.5, Eq. 1):
chosen by estimated throughput under memory budgets. Plain Python, no torch.

A layer is resident on the GPU, or stored in host memory or on disk and streamed into
one of a ring of GPU buffers before it is computed. Embeddings, LM head and norms are
always resident. The planner tries every number of resident layers (streamed layers spread
evenly between them, so each load hides behind the layers computed before its turn) and both
pipelines:

- performance-optimised: buffers for the layers a forward holds at once plus one, so the next
  streamed layer loads while the current one computes;
- memory-efficient: buffers only for the layers held at once; a load starts when a buffer frees.

A forward holds one layer at a time, or two under Neo's two-batch forward (layer i+1's first
sub-batch runs before layer i's second). Each candidate must fit the budgets; a resident layer
costs KV space when the GPU's memory is one budget, so fewer sequences fit a batch.
The candidate with the most decode tokens per second in simulated time (pipeline.py) wins; one that
streams more layers must win by MIN_STREAMING_GAIN (and never wins at the same batch in the same
pipeline: its other loads are the same), and ties go to the least GPU memory. When none fits, `PlacementError` says what
to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from scheduler.planning.cost_model import Curve, ModelShape
from scheduler.planning.memory import (
    GIB_BYTES,
    MemoryBreakdown,
    Quantization,
    WeightFormat,
    activation_peak_bytes,
    kv_block_bytes,
    layer_image_bytes,
    resident_global_bytes,
)
from scheduler.modes import Mode
from scheduler.planning.tiers import Tier
from scheduler.planning.pipeline import ForwardTimeline, simulate_forward

# The tiers' older names, kept as aliases of the enum's members (each string is defined once, in Tier).
TIER_GPU = Tier.GPU
TIER_HOST = Tier.HOST
TIER_DISK = Tier.DISK


class PlacementMode(Mode):
    """--weight-placement: where decoder layers live."""

    AUTO = "auto"  # chosen per layer from the budgets and measured bandwidths
    GPU = "gpu"  # every layer resident
    CPU = "cpu"  # every layer streamed from host memory
    DISK = "disk"  # every layer streamed from files in the offload directory


class WeightPipeline(Mode):
    """--weight-pipeline: how streamed layers pass through the GPU's buffers."""

    AUTO = "auto"  # the one with the higher estimated throughput
    PERFORMANCE = "performance"  # one buffer more: the next streamed layer preloads
    MEMORY = "memory"  # one buffer per layer in use


# The pipelines' older names, kept as aliases of the enum's members.
PIPELINE_PERFORMANCE = WeightPipeline.PERFORMANCE
PIPELINE_MEMORY = WeightPipeline.MEMORY
# Disk layers are read into host buffers first: two, so one load's reads can land while the
# previous load's last copies leave.
NUM_STAGING_BUFFERS = 2
# A placement streaming more layers than another must beat it by this much in estimated
# throughput: within the estimate's error, the one moving fewer bytes is the safer choice.
MIN_STREAMING_GAIN = 0.02


class PlacementError(ValueError):
    """No placement fits the budgets; the message says what to change."""


@dataclass(frozen=True)
class MemoryBudgets:
    """Bytes each place may hold; None where no bound is given."""

    gpu_weight_bytes: int | None = None  # --weights-gpu-gib: resident weights and layer buffers
    gpu_bytes: int | None = None  # --memory-gib: weights, KV pool and activations together
    kv_cache_bytes: int | None = None  # a fixed GPU KV pool; None: what gpu_bytes leaves
    host_weight_bytes: int | None = None  # --weights-cpu-gib: streamed layers kept in host memory
    disk_bytes: int | None = None  # room for layer files in --offload-dir: free space and the files there
    has_offload_dir: bool = False  # whether the disk tier exists at all
    host_kv_cache_bytes: int = 0  # the host KV pool (Neo), for the breakdown


@dataclass(frozen=True)
class TransferRates:
    """Measured bytes per second into the GPU's buffers."""

    link_bytes_per_s: float  # host memory -> GPU
    disk_bytes_per_s: float | None = None  # O_DIRECT reads from the offload directory; None: not measured
    chunk_bytes: int = 8 * 2**20  # a disk load's blocks: the first lands before any copy starts
    # the link while the GPU computes (where both share a memory bus, as on the host-only
    # testbed, each slows the other); None: as fast as alone
    link_bytes_per_s_under_compute: float | None = None

    def load_s(self, tier: Tier, nbytes: int, under_compute: bool = False) -> float:
        """One layer's load: host layers copy at the link's rate; disk layers are read and copied
        block by block, so the slower stage sets the pace, plus one block of the other."""
        link = min(self.link_bytes_per_s, self.link_bytes_per_s_under_compute) \
            if under_compute and self.link_bytes_per_s_under_compute else self.link_bytes_per_s
        link_s = nbytes / link
        if tier == Tier.HOST:
            return link_s
        if not self.disk_bytes_per_s:
            raise PlacementError("the disk tier needs a measured disk read rate")
        disk_s = nbytes / self.disk_bytes_per_s
        block = min(self.chunk_bytes, nbytes)
        return max(link_s, disk_s) + min(block / link, block / self.disk_bytes_per_s)


@dataclass(frozen=True)
class ComputeCosts:
    """Measured GPU time (seconds)."""

    linear: Curve  # one layer's linear work by tokens
    attention_s_per_context_token: float  # one layer's decode attention, per context token read
    head: Curve  # embedding, final norm and LM head by rows
    linear_under_transfer: Curve | None = None  # the same while a load runs beside it; None: no slower


@dataclass(frozen=True)
class Workload:
    """What the engine will run: its batch bounds and the decode the estimate is for."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    context_len: int  # tokens each decoding sequence holds (its prompt and output so far)
    layers_in_use: int = 1  # layers a forward holds at once: 2 under Neo's two-batch forward
    kv_element_bytes: float | None = None  # the KV format's (scheduler/planning/kv_format.py); None: the compute dtype's
    num_speculative_tokens: int = 0  # drafts a sequence may verify in a step (0: no speculative decoding)


@dataclass(frozen=True)
class PlannerInputs:
    shape: ModelShape
    fmt: WeightFormat
    workload: Workload
    budgets: MemoryBudgets
    rates: TransferRates
    costs: ComputeCosts
    mode: PlacementMode = PlacementMode.AUTO
    pipeline: WeightPipeline = WeightPipeline.AUTO

    def __post_init__(self) -> None:
        for name, mode_type in (("mode", PlacementMode), ("pipeline", WeightPipeline)):
            try:
                object.__setattr__(self, name, mode_type.parse(getattr(self, name)))
            except ValueError as exc:
                raise PlacementError(f"weight {'placement' if name == 'mode' else name} {exc}") from None


@dataclass(frozen=True)
class ThroughputEstimate:
    batch: int  # sequences decoded per iteration
    context_len: int
    timeline: ForwardTimeline

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.timeline.iteration_s

    def to_dict(self) -> dict[str, Any]:
        t = self.timeline
        return {"batch": self.batch, "context_len": self.context_len, "iteration_s": t.iteration_s,
                "compute_s": t.compute_s, "transfer_s": t.transfer_s, "stall_s": t.stall_s,
                "tokens_per_s": self.tokens_per_s}


@dataclass(frozen=True)
class WeightPlacement:
    """The planner's decision: each layer's tier, the pipeline, and what it costs and earns."""

    mode: PlacementMode
    tiers: tuple[Tier, ...]  # per decoder layer
    pipeline: WeightPipeline | None  # None when nothing streams
    num_buffers: int  # GPU buffers streamed layers pass through
    layer_bytes: int  # one layer image (the planner's estimate; the engine's own are exact)
    memory: MemoryBreakdown
    estimate: ThroughputEstimate
    load_s: dict[Tier, float] = field(default_factory=dict)  # one layer's load, by tier

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, tier in enumerate(self.tiers) if tier != Tier.GPU)

    def num_layers_in(self, tier: Tier) -> int:
        return sum(t == tier for t in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "tiers": [str(tier) for tier in self.tiers], "pipeline": self.pipeline,
                "num_buffers": self.num_buffers, "layer_bytes": self.layer_bytes,
                "memory": self.memory.to_dict(), "estimate": self.estimate.to_dict(),
                "load_s": {str(tier): seconds for tier, seconds in self.load_s.items()}}


# ---- choosing -------------------------------------------------------------------------------
def resident_layer_counts(mode: PlacementMode, num_layers: int) -> Sequence[int]:
    """The numbers of resident layers a placement mode allows, most first."""
    fixed = {PlacementMode.GPU: [num_layers], PlacementMode.CPU: [0], PlacementMode.DISK: [0]}
    return fixed.get(mode, range(num_layers, -1, -1))


def pipelines_to_try(pipeline: WeightPipeline) -> list[WeightPipeline]:
    """The pipelines --weight-pipeline leaves to compare: both under auto."""
    return [PIPELINE_PERFORMANCE, PIPELINE_MEMORY] if pipeline == WeightPipeline.AUTO else [pipeline]


def plan_placement(inputs: PlannerInputs) -> WeightPlacement:
    """The placement with the highest estimated throughput that fits; PlacementError otherwise."""
    num_layers = inputs.shape.num_layers
    resident_counts = resident_layer_counts(inputs.mode, num_layers)
    pipelines = pipelines_to_try(inputs.pipeline)
    best: WeightPlacement | None = None
    reasons: list[str] = []
    for num_resident in resident_counts:
        for pipeline in pipelines if num_resident < num_layers else [None]:
            candidate = candidate_placement(inputs, num_resident, pipeline)
            if isinstance(candidate, str):
                reasons.append(candidate)
            elif best is None or is_better(candidate, best):
                best = candidate
    if best is None:
        # the last reason is the least demanding candidate's (fewest resident layers, least memory)
        raise PlacementError(f"the model's weights do not fit: {reasons[-1]}")
    return best


def is_better(a: WeightPlacement, b: WeightPlacement) -> bool:
    """Whether `a` beats `b`: streaming more layers must earn MIN_STREAMING_GAIN more throughput
    (loads cost link bandwidth and host cores the estimate does not charge), else the faster wins,
    then the smaller."""
    rate_a, rate_b = a.estimate.tokens_per_s, b.estimate.tokens_per_s
    streamed_a, streamed_b = len(a.streamed_layers), len(b.streamed_layers)
    if streamed_a != streamed_b and _same_pipeline(a, b) and a.estimate.batch == b.estimate.batch:
        return streamed_a < streamed_b  # a layer kept resident only drops a load: faster estimates are noise
    if streamed_a != streamed_b:
        more, fewer = (rate_a, rate_b) if streamed_a > streamed_b else (rate_b, rate_a)
        more_wins = more > fewer * (1 + MIN_STREAMING_GAIN)
        return more_wins == (streamed_a > streamed_b)
    if abs(rate_a - rate_b) > 1e-9 * max(rate_a, rate_b):
        return rate_a > rate_b
    return a.memory.gpu_bytes < b.memory.gpu_bytes


def _same_pipeline(a: WeightPlacement, b: WeightPlacement) -> bool:
    return a.pipeline is None or b.pipeline is None or a.pipeline == b.pipeline


def spread(num_chosen: int, num_total: int) -> list[bool]:
    """Which of `num_total` slots are chosen, `num_chosen` of them spread evenly."""
    return [(i + 1) * num_chosen // num_total > i * num_chosen // num_total for i in range(num_total)]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB_BYTES:.2f} GiB"


def num_layer_buffers(workload: Workload, num_streamed: int, pipeline: str | None) -> int:
    """The GPU buffers `num_streamed` whole layers stream through: one per layer a forward
    holds at once, and one more preloading under the performance pipeline."""
    if not num_streamed:
        return 0
    return min(num_streamed, workload.layers_in_use + (pipeline == PIPELINE_PERFORMANCE))


def candidate_placement(inputs: PlannerInputs, num_resident: int, pipeline: str | None) -> WeightPlacement | str:
    """The placement with `num_resident` resident layers, or why it does not fit."""
    shape, fmt, budgets = inputs.shape, inputs.fmt, inputs.budgets
    num_buffers = num_layer_buffers(inputs.workload, shape.num_layers - num_resident, pipeline)
    layer_bytes = layer_image_bytes(shape, fmt)
    global_bytes = resident_global_bytes(shape, fmt.dtype_bytes)
    weight_bytes = global_bytes + (num_resident + num_buffers) * layer_bytes
    if budgets.gpu_weight_bytes is not None and weight_bytes > budgets.gpu_weight_bytes:
        return (f"the GPU needs {_gib(weight_bytes)} for weights (embeddings, LM head and norms "
                f"{_gib(global_bytes)}, {num_resident} resident layers and {num_buffers} layer buffers of "
                f"{_gib(layer_bytes)}) but --weights-gpu-gib gives {_gib(budgets.gpu_weight_bytes)}; "
                f"give more{_int4_hint(fmt)}")
    tiers = layer_tiers(inputs, num_resident)
    if isinstance(tiers, str):
        return tiers
    return placement_of(inputs, tiers, pipeline, num_buffers, num_resident * layer_bytes, num_buffers * layer_bytes)


def placement_of(inputs: PlannerInputs, tiers: Sequence[Tier], pipeline: str | None, num_buffers: int,
                 resident_layer_bytes: int, buffer_bytes: int) -> WeightPlacement | str:
    """The placement of these tiers with its memory and estimate, its resident layers taking
    `resident_layer_bytes` and its buffers `buffer_bytes` of GPU memory (whole layers, or
    as the joint planner slices them); or why the KV pool or the estimate does not work out."""
    shape, fmt, work, budgets = inputs.shape, inputs.fmt, inputs.workload, inputs.budgets
    layer_bytes = layer_image_bytes(shape, fmt)
    global_bytes = resident_global_bytes(shape, fmt.dtype_bytes)
    activation_bytes = activation_peak_bytes(shape, fmt, work.max_num_batched_tokens, work.max_num_seqs)
    kv = _kv_cache_bytes(inputs, global_bytes + resident_layer_bytes + buffer_bytes + activation_bytes)
    if isinstance(kv, str):
        return kv
    num_host, num_disk = tiers.count(Tier.HOST), tiers.count(Tier.DISK)
    memory = MemoryBreakdown(
        global_bytes=global_bytes, resident_layer_bytes=resident_layer_bytes,
        buffer_bytes=buffer_bytes, kv_cache_bytes=kv, activation_bytes=activation_bytes,
        host_layer_bytes=num_host * layer_bytes, staging_bytes=NUM_STAGING_BUFFERS * layer_bytes if num_disk else 0,
        host_kv_cache_bytes=budgets.host_kv_cache_bytes, disk_layer_bytes=num_disk * layer_bytes)
    estimate = _estimate(inputs, list(tiers), num_buffers, kv, layer_bytes)
    if isinstance(estimate, str):
        return estimate
    estimate, load_s = estimate
    streams = num_host + num_disk > 0
    return WeightPlacement(inputs.mode, tuple(tiers), pipeline if streams else None, num_buffers, layer_bytes,
                           memory, estimate, load_s)


def _int4_hint(fmt: WeightFormat) -> str:
    return ", or --quantization int4 (layers about 3/8 the size of 16-bit ones)" if fmt.quantization == Quantization.NONE else ""


def _kv_block_bytes(inputs: PlannerInputs) -> int:
    work = inputs.workload
    return kv_block_bytes(inputs.shape, work.block_size, work.kv_element_bytes or inputs.fmt.dtype_bytes)


def _kv_cache_bytes(inputs: PlannerInputs, other_bytes: int) -> int | str:
    """The GPU KV pool: fixed, or what the GPU budget leaves (at least one
    sequence of max_model_len tokens)."""
    budgets, work = inputs.budgets, inputs.workload
    block_bytes = _kv_block_bytes(inputs)
    min_bytes = -(-work.max_model_len // work.block_size) * block_bytes
    if budgets.kv_cache_bytes is not None:
        kv = budgets.kv_cache_bytes
        total = other_bytes + kv
        if budgets.gpu_bytes is not None and total > budgets.gpu_bytes:
            return (f"weights, activations and the KV pool need {_gib(total)} of GPU memory but "
                    f"--memory-gib gives {_gib(budgets.gpu_bytes)}")
        return kv
    if budgets.gpu_bytes is None:
        raise PlacementError("give a KV pool size or a GPU memory budget")
    kv = (budgets.gpu_bytes - other_bytes) // block_bytes * block_bytes
    if kv < min_bytes:
        return (f"weights and activations take {_gib(other_bytes)} of the {_gib(budgets.gpu_bytes)} "
                f"--memory-gib gives, leaving less than one {work.max_model_len}-token sequence of KV cache "
                f"({_gib(min_bytes)}); give more memory, a smaller --weights-gpu-gib or --max-model-len"
                f"{_int4_hint(inputs.fmt)}")
    return kv


def layer_tiers(inputs: PlannerInputs, num_resident: int) -> list[Tier] | str:
    """Resident layers spread among streamed ones; streamed layers in host memory while the host
    budget lasts, the rest (spread among them) on disk; or why they do not fit there."""
    budgets, num_layers = inputs.budgets, inputs.shape.num_layers
    layer_bytes = layer_image_bytes(inputs.shape, inputs.fmt)
    num_streamed = num_layers - num_resident
    num_host = 0 if inputs.mode == PlacementMode.DISK else _num_host_layers(budgets.host_weight_bytes, num_streamed, layer_bytes)
    num_disk = num_streamed - num_host
    if inputs.mode == PlacementMode.CPU and num_disk:
        return (f"{num_streamed} layers of {_gib(layer_bytes)} stream from host memory but --weights-cpu-gib "
                f"gives {_gib(budgets.host_weight_bytes or 0)}; give more, or --weight-placement auto with "
                f"--offload-dir")
    if num_disk and not budgets.has_offload_dir:
        return (f"{num_disk} layers ({_gib(num_disk * layer_bytes)}) fit neither the GPU nor host memory "
                f"(--weights-cpu-gib {_gib(budgets.host_weight_bytes or 0)}); give --offload-dir to stream them "
                f"from disk, or more --weights-cpu-gib / --weights-gpu-gib{_int4_hint(inputs.fmt)}")
    if num_disk and budgets.disk_bytes is not None and num_disk * layer_bytes > budgets.disk_bytes:
        need, room = num_disk * layer_bytes, budgets.disk_bytes
        return (f"{num_disk} layers need {_gib(need)} ({need} bytes) in --offload-dir, which has room for "
                f"{_gib(room)} ({room} bytes: its free space and the layer files there): {_gib(need - room)} "
                f"({need - room} bytes) missing; free space there, or point --offload-dir at a filesystem with room")
    streamed_on_disk = iter(spread(num_disk, num_streamed))
    return [Tier.GPU if resident else (Tier.DISK if next(streamed_on_disk) else Tier.HOST)
            for resident in spread(num_resident, num_layers)]


def _num_host_layers(host_weight_bytes: int | None, num_streamed: int, layer_bytes: int) -> int:
    """Streamed layers host memory holds; once some go to disk, the staging buffers their reads land
    in come out of the same budget."""
    if host_weight_bytes is None or num_streamed * layer_bytes <= host_weight_bytes:
        return num_streamed
    return max(0, min(num_streamed, (host_weight_bytes - NUM_STAGING_BUFFERS * layer_bytes) // layer_bytes))


def _estimate(inputs: PlannerInputs, tiers: list[Tier], num_buffers: int, kv_bytes: int,
              layer_bytes: int) -> tuple[ThroughputEstimate, dict[Tier, float]] | str:
    """Decode throughput: as many sequences of `context_len` tokens as the KV pool and
    max_num_seqs allow, one token each per forward; and one layer's load per tier."""
    work = inputs.workload
    block_bytes = _kv_block_bytes(inputs)
    blocks_per_seq = -(-work.context_len // work.block_size)
    batch = min(work.max_num_seqs, kv_bytes // block_bytes // blocks_per_seq)
    if batch < 1:
        return f"the KV pool ({_gib(kv_bytes)}) holds no {work.context_len}-token sequence"
    attention_s = inputs.costs.attention_s_per_context_token * batch * work.context_len
    timeline, load_s = forward_timeline(inputs, tiers, num_buffers, layer_bytes, batch, attention_s)
    return ThroughputEstimate(batch, work.context_len, timeline), load_s


def forward_timeline(inputs: PlannerInputs, tiers: Sequence[Tier], num_buffers: int, layer_bytes: int,
                     num_tokens: int, attention_s: float) -> tuple[ForwardTimeline, dict[Tier, float]]:
    """One forward of `num_tokens` tokens whose layers each also spend `attention_s` on the GPU,
    its streamed layers loaded through the ring; and one layer's load per tier.

    Where loads and computes slow each other (measured: `linear_under_transfer`,
    `link_bytes_per_s_under_compute`), the forward is replayed once with the rates alone, and
    again with each side slowed in proportion to the time the first replay ran them together."""
    work, costs, rates = inputs.workload, inputs.costs, inputs.rates
    streamed_tiers = [tier for tier in (Tier.HOST, Tier.DISK) if tier in tiers]

    def replay(compute_share: float, load_share: float) -> tuple[ForwardTimeline, dict[Tier, float]]:
        alone = costs.linear(num_tokens)
        # a load beside never speeds compute (nor compute a load): a reading below alone is noise
        busy = max(alone, costs.linear_under_transfer(num_tokens)) if costs.linear_under_transfer else alone
        layer_s = alone + (busy - alone) * compute_share + attention_s
        load_s = {tier: (1 - load_share) * rates.load_s(tier, layer_bytes)
                  + load_share * rates.load_s(tier, layer_bytes, under_compute=True) for tier in streamed_tiers}
        timeline = simulate_forward([layer_s] * len(tiers), [load_s.get(tier) for tier in tiers], num_buffers,
                                    costs.head(num_tokens), work.layers_in_use)
        return timeline, load_s

    timeline, load_s = replay(0.0, 0.0)
    if streamed_tiers and timeline.overlap_s > 0:
        timeline, load_s = replay(timeline.overlap_s / timeline.compute_s, timeline.overlap_s / timeline.transfer_s)
    return timeline, load_s


# ---- reporting ------------------------------------------------------------------------------
def describe(placement: WeightPlacement, offload_dir: str | None = None) -> str:
    """The memory breakdown, the pipeline and the expected speed, as `tandem plan` prints them."""
    m, est, t = placement.memory, placement.estimate, placement.estimate.timeline
    num_layers = len(placement.tiers)
    num_host, num_disk = placement.num_layers_in(Tier.HOST), placement.num_layers_in(Tier.DISK)
    resident = placement.num_layers_in(Tier.GPU)
    if placement.pipeline is None:
        streaming = "nothing streams"
    else:
        name = "performance-optimised" if placement.pipeline == PIPELINE_PERFORMANCE else "memory-efficient"
        streaming = (f"{num_layers - resident} streamed ({num_host} from host memory, {num_disk} from disk"
                     f"{f' in {offload_dir}' if num_disk and offload_dir else ''}), {name} pipeline "
                     f"({placement.num_buffers} layer buffers)")
    lines = [
        f"weight placement ({placement.mode}): {resident} of {num_layers} layers on the GPU, {streaming}",
        f"  layer {placement.layer_bytes / 2**20:.1f} MiB; layers by tier: {''.join(t[0].upper() for t in placement.tiers)}"
        f" (G GPU, H host, D disk)",
        "memory (GiB):",
        f"  GPU          {m.gpu_bytes / GIB_BYTES:7.2f}  weights {m.gpu_weight_bytes / GIB_BYTES:.2f} "
        f"(embeddings, head, norms {m.global_bytes / GIB_BYTES:.2f}; resident layers {m.resident_layer_bytes / GIB_BYTES:.2f}; "
        f"layer buffers {m.buffer_bytes / GIB_BYTES:.2f}), KV pool {m.kv_cache_bytes / GIB_BYTES:.2f}, "
        f"activations {m.activation_bytes / GIB_BYTES:.2f} peak",
        f"  host         {m.host_bytes / GIB_BYTES:7.2f}  streamed layers {m.host_layer_bytes / GIB_BYTES:.2f}, "
        f"disk staging {m.staging_bytes / GIB_BYTES:.2f}, KV pool {m.host_kv_cache_bytes / GIB_BYTES:.2f}",
        f"  disk         {m.disk_layer_bytes / GIB_BYTES:7.2f}  streamed layers",
    ]
    if placement.load_s:
        loads = ", ".join(f"{tier} {seconds * 1e3:.1f} ms" for tier, seconds in placement.load_s.items())
        lines.append(f"one layer's load: {loads}")
    bound = "transfer-bound" if t.transfer_s > t.compute_s else "compute-bound"
    lines.append(f"expected: decode batch {est.batch} at {est.context_len}-token contexts: "
                 f"{t.iteration_s * 1e3:.1f} ms a forward (compute {t.compute_s * 1e3:.1f} ms, transfer "
                 f"{t.transfer_s * 1e3:.1f} ms{', ' + bound if placement.pipeline else ''}), "
                 f"{est.tokens_per_s:.1f} tokens/s")
    return "\n".join(lines)
