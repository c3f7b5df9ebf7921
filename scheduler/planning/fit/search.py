"""The fit: from two memory budgets and an expected workload, the weight format, the KV format,
which layers live where and how big both KV pools are (LM-Offload sec. 3's decisions, PIPO
App. B's automatic configuration). Plain Python, no torch.

Every option is a (weight format, KV format) pair with its loss rank: 0 is lossless (GGUF Q4
tensors kept packed, or weights as stored; the compute dtype's KV). For each option every
placement is tried (resident layers spread among streamed ones, both pipelines), each with its
memory and its performance-model prediction, and the fastest that fits is the option's. The
fit takes the lossless option, then a lossier one only where it is predicted at least
MIN_LOSSY_GAIN faster than the one taken so far, or where nothing less lossy fits at all; and a
lossy option is weighed only when memory binds (the lossless one does not fit, streams layers, or
its pools hold fewer sequences than --max-num-seqs at the expected context), since a format that
only computes faster would change the model's numbers for speed alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from scheduler.planning.cost_model import ModelShape
from scheduler.planning.fit.model import AttentionCosts, KVCapacity, Prediction, predict
from scheduler.planning.kv_format import KVFormat
from scheduler.planning.memory import (
    GIB_BYTES,
    WeightFormat,
    activation_peak_bytes,
    kv_block_bytes,
    layer_image_bytes,
    resident_global_bytes,
)
from scheduler.planning.placement import (
    NUM_STAGING_BUFFERS,
    ComputeCosts,
    MemoryBudgets,
    PlacementError,
    PlacementMode,
    PlannerInputs,
    TransferRates,
    WeightPipeline,
    Workload,
    layer_tiers,
    num_layer_buffers,
    pipelines_to_try,
    resident_layer_counts,
)
from scheduler.planning.tiers import Tier

# A lossy option must be predicted this much faster than the less lossy one taken before it.
MIN_LOSSY_GAIN = 0.25
# Pool sizes when no budget sizes them (device cpu and the testbed without --gpu-memory-gib /
# --host-memory-gib): the engine's defaults before the fit.
DEFAULT_GPU_KV_BYTES = 1 * GIB_BYTES
DEFAULT_HOST_KV_BYTES = 4 * GIB_BYTES


class FitError(PlacementError):
    """Nothing fits; the message says what does not and which flag to change."""


@dataclass(frozen=True)
class FitOption:
    """A weight format and a KV format, and how much the pair loses (0: nothing)."""

    quantization: str  # none | int4
    kv: KVFormat
    loss_rank: int

    def describe(self) -> str:
        return f"weights {self.quantization}, {self.kv.name} KV"


@dataclass(frozen=True)
class FitBudgets:
    """Bytes the fit may place. `shared_memory`: the GPU's memory is the host's (device cpu and
    the testbed with no GPU budget), so both come out of `host_bytes` and streaming a layer from
    host memory would free nothing. `pools_by_budget`: the KV pools take what the budgets leave
    (capped at what the workload can use); else they keep the defaults above."""

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int | None  # free space where disk-tier layers would go; None: no disk tier
    shared_memory: bool = False
    pools_by_budget: bool = True
    neo: bool = True  # a host KV pool with CPU attention


@dataclass(frozen=True)
class FixedChoices:
    """What the user's flags fix; None: the fit chooses."""

    gpu_kv_blocks: int | None = None  # --num-gpu-blocks
    gpu_kv_bytes: int | None = None  # --kv-cache-gib
    host_kv_blocks: int | None = None  # --num-cpu-blocks
    host_kv_bytes: int | None = None  # --cpu-kv-cache-gib
    max_model_len: bool = False  # --max-model-len given: the GPU pool must hold it (else the pool caps it)
    max_num_batched_tokens: bool = False  # --max-num-batched-tokens given (else a TTFT target may raise it)
    gpu_weight_bytes: int | None = None  # --weights-gpu-gib
    host_weight_bytes: int | None = None  # --weights-cpu-gib
    placement: PlacementMode = PlacementMode.AUTO  # --weight-placement
    pipeline: WeightPipeline = WeightPipeline.AUTO  # --weight-pipeline


@dataclass(frozen=True)
class FitProbes:
    """This machine's measurements: transfer rates, each weight format's compute costs (measured
    on first use), the attention costs per KV format."""

    rates: TransferRates
    compute: Callable[[str], ComputeCosts]
    attention: AttentionCosts


@dataclass(frozen=True)
class FitRequest:
    shape: ModelShape
    dtype_bytes: int
    options: tuple[FitOption, ...]  # the lossless one first
    workload: Workload
    budgets: FitBudgets
    measure: Callable[[], FitProbes]  # called only where speed decides (or `predict_always`)
    fixed: FixedChoices = FixedChoices()
    predict_always: bool = False  # `tandem plan`: the expected speed even where memory alone decides (the same choice)
    ttft_target_s: float | None = None  # --ttft-target-s: plans that meet it first (None: no bound)

    def meets_ttft(self, configuration: "Configuration") -> bool:
        return self.ttft_target_s is None or configuration.prediction.ttft_s <= self.ttft_target_s


@dataclass(frozen=True)
class Configuration:
    """One option at one placement, with its memory and, where measured, its prediction."""

    option: FitOption
    tiers: tuple[Tier, ...]
    pipeline: str | None
    num_buffers: int
    layer_bytes: int
    gpu_weight_bytes: int  # embeddings, head, norms, resident layers, layer buffers
    activation_bytes: int
    gpu_kv_bytes: int
    host_layer_bytes: int  # streamed layers in host memory, and the disk reads' staging buffers
    host_kv_bytes: int
    disk_layer_bytes: int
    max_model_len: int  # the longest sequence: the workload's, or what the GPU pool holds where not fixed
    prediction: Prediction | None = None

    @property
    def num_resident(self) -> int:
        return self.tiers.count(Tier.GPU)

    @property
    def streams(self) -> bool:
        return self.num_resident < len(self.tiers)

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_weight_bytes + self.activation_bytes + self.gpu_kv_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_layer_bytes + self.host_kv_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"quantization": self.option.quantization, "kv_cache_dtype": self.option.kv.name,
                "loss_rank": self.option.loss_rank, "tiers": "".join(str(t)[0].upper() for t in self.tiers),
                "pipeline": self.pipeline, "num_buffers": self.num_buffers, "layer_bytes": self.layer_bytes,
                "gpu_weight_bytes": self.gpu_weight_bytes, "activation_bytes": self.activation_bytes,
                "gpu_kv_bytes": self.gpu_kv_bytes, "host_layer_bytes": self.host_layer_bytes,
                "host_kv_bytes": self.host_kv_bytes, "disk_layer_bytes": self.disk_layer_bytes,
                "gpu_bytes": self.gpu_bytes, "host_bytes": self.host_bytes, "max_model_len": self.max_model_len,
                "prediction": None if self.prediction is None else self.prediction.to_dict()}


@dataclass(frozen=True)
class Fit:
    """The fit's choice, the best configuration of every option weighed, and why it chose."""

    chosen: Configuration
    reason: str
    options: tuple[Configuration, ...] = ()  # each option's best, where it fits
    refused: dict[str, str] = field(default_factory=dict)  # option -> why it fits nowhere
    max_num_batched_tokens: int | None = None  # the chunk budget a TTFT target raised (None: as it was)

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.to_dict(), "reason": self.reason,
                "options": [c.to_dict() for c in self.options], "refused": dict(self.refused),
                "max_num_batched_tokens": self.max_num_batched_tokens}


def fit(request: FitRequest) -> Fit:
    """The configuration to run; FitError naming what does not fit and the flag to change. Where
    a TTFT target is missed at the chunk budget and no flag fixes it, the budget doubles (up to
    max_model_len) until a plan meets the target: a prompt in fewer, larger forwards (streamed
    layers load once a forward)."""
    request = replace(request, measure=functools.cache(request.measure))  # measured once however often fitted
    result = _fit(request)
    work = request.workload
    if request.meets_ttft(result.chosen) or request.fixed.max_num_batched_tokens:
        return result
    budget = work.max_num_batched_tokens
    while budget < work.max_model_len:
        budget = min(2 * budget, work.max_model_len)
        try:
            larger = _fit(replace(request, workload=replace(work, max_num_batched_tokens=budget)))
        except FitError:  # its activations leave no room
            break
        if request.meets_ttft(larger.chosen):
            return replace(larger, max_num_batched_tokens=budget, reason=(
                f"{larger.reason}; chunks of {budget} tokens (not {work.max_num_batched_tokens}) meet the TTFT "
                f"target of {request.ttft_target_s:g} s"))
    return result


def _fit(request: FitRequest) -> Fit:
    lossless = request.options[0]
    first = placements_of(request, lossless, None)
    resident = [c for c in first if not isinstance(c, str) and not c.streams]
    if resident and not _memory_binds(request, resident[0]):
        reason = "everything fits resident; nothing is quantized that is not stored so"
        if not request.predict_always and request.ttft_target_s is None:
            return Fit(resident[0], reason)
        # the same choice, with its expected speed: predicting never changes what runs (nothing the
        # fit weighs prefills faster than every layer resident in the lossless formats)
        predicted = with_predictions(request, resident[:1], request.measure())[0]
        if isinstance(predicted, str):
            return Fit(resident[0], reason)
        return Fit(predicted, reason + _ttft_note(request, predicted), (predicted,))
    probes = request.measure()
    weighed = [first] + [placements_of(request, option, None) for option in request.options[1:]]
    best, refused = [], {}
    for option, configurations in zip(request.options, weighed):
        measured = _best(request, with_predictions(request, configurations, probes))
        if isinstance(measured, str) or measured is None:
            refused[option.describe()] = measured or f"no placement of {option.describe()} fits"
        else:
            best.append(measured)
    return _choose(request, tuple(best), refused)


def _choose(request: FitRequest, best: tuple[Configuration, ...], refused: dict[str, str]) -> Fit:
    """The lossless option's best, then each lossier one's where it earns MIN_LOSSY_GAIN (or is the
    first to fit), weighed only while memory binds; with a TTFT target, one that meets it before
    one that does not, lossier or slower."""
    if not best:
        raise FitError(_refusal(request, refused))
    taken, reason = None, ""
    for candidate in sorted(best, key=lambda c: c.option.loss_rank):
        if taken is None:
            taken = candidate
            reason = ("the lossless choice" if candidate.option.loss_rank == 0 else
                      f"nothing less lossy fits ({'; '.join(refused.values())})")
            continue
        if candidate.option.loss_rank == 0 or not _memory_binds(request, taken):
            continue
        if request.meets_ttft(candidate) and not request.meets_ttft(taken):
            reason = (f"{candidate.option.describe()} meets the TTFT target of {request.ttft_target_s:g} s "
                      f"(predicted {candidate.prediction.ttft_s:.2f} s; {taken.option.describe()} "
                      f"{taken.prediction.ttft_s:.2f} s)")
            taken = candidate
            continue
        gain = candidate.prediction.tokens_per_s / taken.prediction.tokens_per_s
        if gain >= 1 + MIN_LOSSY_GAIN and request.meets_ttft(candidate) >= request.meets_ttft(taken):
            reason = (f"{candidate.option.describe()} predicted {gain:.2f}x the tokens/s of "
                      f"{taken.option.describe()} (at least {1 + MIN_LOSSY_GAIN:.2f}x taken, memory binding)")
            taken = candidate
    return Fit(taken, reason + _ttft_note(request, taken), best, refused)


def _ttft_note(request: FitRequest, chosen: Configuration) -> str:
    """What the reason adds under a TTFT target: that the choice meets it, or that nothing weighed does."""
    if request.ttft_target_s is None:
        return ""
    if request.meets_ttft(chosen):
        return (f"; meets the TTFT target of {request.ttft_target_s:g} s (predicted {chosen.prediction.ttft_s:.2f} s, "
                f"the fastest decode among the placements that do)")
    return (f"; no plan weighed meets the TTFT target of {request.ttft_target_s:g} s (this one: "
            f"{chosen.prediction.ttft_s:.2f} s; a larger --max-num-batched-tokens or a shorter prompt prefills faster)")


def _memory_binds(request: FitRequest, configuration: Configuration) -> bool:
    """Whether memory limits this configuration: it streams layers, or its pools (sized by the
    budgets) hold fewer than max_num_seqs sequences of the expected context."""
    if configuration.streams:
        return True
    if not request.budgets.pools_by_budget:
        return False
    work = request.workload
    capacity = _capacity(request, configuration.option.kv, configuration.gpu_kv_bytes, configuration.host_kv_bytes)
    context_len = min(work.context_len, configuration.max_model_len)
    return sum(capacity.sequences(context_len, work.block_size)) < work.max_num_seqs


def _best(request: FitRequest, configurations: list[Configuration | str]) -> Configuration | str | None:
    """The fastest that fits among those meeting the TTFT target, where any does (ties: the fewest
    streamed layers, then the least GPU memory); the first reason if none fits."""
    fitting = [c for c in configurations if not isinstance(c, str)]
    if not fitting:
        return next(iter(configurations), None)
    return max(fitting, key=lambda c: (request.meets_ttft(c), round(c.prediction.tokens_per_s, 9), c.num_resident,
                                       -c.gpu_bytes))


def with_predictions(request: FitRequest, configurations: list[Configuration | str],
                     probes: FitProbes) -> list[Configuration | str]:
    """Each configuration with the model's prediction (the length capped as its GPU pool caps it),
    or why it serves no sequence; reasons passed through."""
    out: list[Configuration | str] = []
    for c in configurations:
        if isinstance(c, str):
            out.append(c)
            continue
        inputs = _planner_inputs(request, c.option, probes)
        work = inputs.workload
        inputs = replace(inputs, workload=replace(work, max_model_len=c.max_model_len,
                                                  context_len=min(work.context_len, c.max_model_len)))
        capacity = _capacity(request, c.option.kv, c.gpu_kv_bytes, c.host_kv_bytes)
        prediction = predict(inputs, c.tiers, c.num_buffers, c.layer_bytes, c.option.kv, probes.attention, capacity)
        out.append(prediction if isinstance(prediction, str) else replace(c, prediction=prediction))
    return out


def _planner_inputs(request: FitRequest, option: FitOption, probes: FitProbes | None) -> PlannerInputs:
    """The placement planner's inputs for this option (rates and costs only where measured)."""
    fixed = request.fixed
    fmt = WeightFormat(option.quantization, request.dtype_bytes)
    budgets = request.budgets
    host_weights = 0 if budgets.shared_memory else budgets.host_bytes
    if fixed.host_weight_bytes is not None:
        host_weights = fixed.host_weight_bytes
    placement_budgets = MemoryBudgets(host_weight_bytes=host_weights, disk_bytes=budgets.disk_bytes,
                                      has_offload_dir=budgets.disk_bytes is not None)
    workload = replace(request.workload, kv_element_bytes=option.kv.element_bytes)
    rates = probes.rates if probes else TransferRates(1.0)
    costs = probes.compute(option.quantization) if probes else None
    return PlannerInputs(request.shape, fmt, workload, placement_budgets, rates, costs,
                         mode=fixed.placement, pipeline=fixed.pipeline)


def placements_of(request: FitRequest, option: FitOption, probes: FitProbes | None) -> list[Configuration | str]:
    """Every placement of this option (most resident layers first) with its memory, or why it
    does not fit."""
    inputs = _planner_inputs(request, option, probes)
    num_layers = request.shape.num_layers
    counts = resident_layer_counts(request.fixed.placement, num_layers)
    pipelines = pipelines_to_try(request.fixed.pipeline)
    out: list[Configuration | str] = []
    for num_resident in counts:
        for pipeline in pipelines if num_resident < num_layers else [None]:
            out.append(_configuration(request, inputs, option, num_resident, pipeline))
    return out


def _configuration(request: FitRequest, inputs: PlannerInputs, option: FitOption, num_resident: int,
                   pipeline: str | None) -> Configuration | str:
    shape, budgets, fixed, work = request.shape, request.budgets, request.fixed, request.workload
    fmt = inputs.fmt
    layer_bytes = layer_image_bytes(shape, fmt)
    num_buffers = num_layer_buffers(work, shape.num_layers - num_resident, pipeline)
    weight_bytes = resident_global_bytes(shape, fmt.dtype_bytes) + (num_resident + num_buffers) * layer_bytes
    if fixed.gpu_weight_bytes is not None and weight_bytes > fixed.gpu_weight_bytes:
        return (f"{_gib(weight_bytes)} of weights on the GPU ({num_resident} resident layers) exceed "
                f"--weights-gpu-gib {_gib(fixed.gpu_weight_bytes)}")
    tiers = layer_tiers(inputs, num_resident)
    if isinstance(tiers, str):
        return tiers
    num_host, num_disk = tiers.count(Tier.HOST), tiers.count(Tier.DISK)
    host_layer_bytes = num_host * layer_bytes + (NUM_STAGING_BUFFERS * layer_bytes if num_disk else 0)
    activation_bytes = activation_peak_bytes(shape, fmt, work.max_num_batched_tokens, work.max_num_seqs)
    gpu_used = weight_bytes + activation_bytes
    pools = _pools(request, option.kv, gpu_used, host_layer_bytes)
    if isinstance(pools, str):
        return pools
    gpu_kv, host_kv, max_model_len = pools
    return Configuration(option, tuple(tiers), pipeline if num_host + num_disk else None, num_buffers, layer_bytes,
                         weight_bytes, activation_bytes, gpu_kv, host_layer_bytes, host_kv, num_disk * layer_bytes,
                         max_model_len)


def _pools(request: FitRequest, kv: KVFormat, gpu_used: int, host_used: int) -> tuple[int, int, int] | str:
    """Both KV pools' bytes, in whole blocks, and the longest sequence, or why they do not fit: the
    GPU pool must hold one max_model_len sequence where --max-model-len is given (the scheduler
    runs every sequence on the GPU at some point), else it caps the sequences' length."""
    budgets, fixed, work = request.budgets, request.fixed, request.workload
    block_bytes = kv_block_bytes(request.shape, work.block_size, kv.element_bytes)
    need_bytes = work.max_num_seqs * -(-work.max_model_len // work.block_size) * block_bytes
    gpu_room = budgets.gpu_bytes - gpu_used
    host_room = budgets.host_bytes - host_used
    if budgets.shared_memory:
        gpu_room = host_room = budgets.host_bytes - gpu_used - host_used
    gpu_kv = _pool_bytes(fixed.gpu_kv_blocks, fixed.gpu_kv_bytes, budgets.pools_by_budget, gpu_room,
                         min(DEFAULT_GPU_KV_BYTES, need_bytes), need_bytes, block_bytes)
    if gpu_kv > gpu_room:
        return (f"the GPU KV pool ({_gib(gpu_kv)}) beside {_gib(gpu_used)} of weights and activations exceeds "
                f"{_gib(budgets.gpu_bytes)}")
    num_blocks = gpu_kv // block_bytes
    max_model_len = work.max_model_len if fixed.max_model_len else min(work.max_model_len, num_blocks * work.block_size)
    if num_blocks * work.block_size < max_model_len or num_blocks < 1:
        return (f"after {_gib(gpu_used)} of weights and activations the GPU KV pool ({_gib(gpu_kv)}) holds no "
                f"{work.max_model_len}-token sequence in {kv.name}")
    if budgets.shared_memory:
        host_room -= gpu_kv
    host_kv = 0
    if budgets.neo:
        host_kv = _pool_bytes(fixed.host_kv_blocks, fixed.host_kv_bytes, budgets.pools_by_budget, host_room,
                              min(DEFAULT_HOST_KV_BYTES, host_room), need_bytes, block_bytes)
        if host_kv < block_bytes:
            return f"host memory holds no KV block beside {_gib(host_used)} of streamed layers"
    if host_kv > host_room:
        return (f"streamed layers ({_gib(host_used)}) and the host KV pool ({_gib(host_kv)}) exceed "
                f"{_gib(budgets.host_bytes)} of host memory")
    return gpu_kv, host_kv, max_model_len


def _pool_bytes(fixed_blocks: int | None, fixed_bytes: int | None, by_budget: bool, room: int, default: int,
                need: int, block_bytes: int) -> int:
    """A pool's bytes in whole blocks: fixed by a flag, else what the budget leaves (up to what the
    workload can use), else the default."""
    if fixed_blocks is not None:
        return fixed_blocks * block_bytes
    chosen = fixed_bytes if fixed_bytes is not None else (min(room, need) if by_budget else default)
    return max(0, chosen) // block_bytes * block_bytes


def _capacity(request: FitRequest, kv: KVFormat, gpu_kv_bytes: int, host_kv_bytes: int) -> KVCapacity:
    block_bytes = kv_block_bytes(request.shape, request.workload.block_size, kv.element_bytes)
    block_size = request.workload.block_size
    return KVCapacity(gpu_kv_bytes // block_bytes * block_size, host_kv_bytes // block_bytes * block_size)


def _refusal(request: FitRequest, refused: dict[str, str]) -> str:
    """Why nothing fits, with the flags that change it."""
    b = request.budgets
    reasons = "; ".join(f"{option}: {why}" for option, why in refused.items())
    disk = "" if b.disk_bytes is not None else ", --offload-dir (stream layers from disk)"
    return (f"the model does not fit in {_gib(b.gpu_bytes)} of GPU memory and {_gib(b.host_bytes)} of host memory "
            f"({reasons}); give more --gpu-memory-gib / --host-memory-gib, a smaller --max-model-len or "
            f"--max-num-seqs{disk}, or drop a flag that pins a choice (--quantization, --kv-cache-dtype)")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB_BYTES:.2f} GiB"
