"""The joint planner (issue 30): one call decides, within one GPU weight budget, which
decoder layers stream whole (PIPO, planner.py) and how the others' MLPs are sliced (ScheInfer,
slicing_plan.py), and returns one `ModelPlan`. Plain Python, no torch.

- Slicing off: the placement planner's tiers where streaming is requested, else every layer resident.
- Fixed rates (`--mlp-slicing CC,CG`): the placement planner's tiers where streaming is requested;
  every resident layer sliced at its rates.
- Solved rates (`--mlp-slicing auto`): every layer sliced within the budget if that fits; else the
  fewest layers streamed whole that let the others be sliced within what the budget leaves. Fewest,
  because a layer streamed whole moves its attention weights over the link every forward, while a
  CC part moves nothing. The streamed layers are spread among the sliced ones and sit in host
  memory, then on disk, as the placement planner places them.

Layers streamed whole and CG parts pass through one ring of GPU buffers
(layer_plan.ring_size); the plan's weight bytes count it once. A mixture-of-experts layer never
streams whole (the layer images and their probes hold dense layers): its experts are sliced instead.
The link, disk and compute measurements behind a placement are taken only where whole layers may
stream (`PlacementRequest.measure`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from scheduler.planning.cost_model import ModelShape
from scheduler.planning.layer_plan import LayerPlan, ModelPlan, Tier
from scheduler.planning.memory import GIB_BYTES, WeightFormat, layer_image_bytes, resident_global_bytes
from scheduler.planning.placement import (
    ComputeCosts,
    MemoryBudgets,
    PlacementError,
    PlacementMode,
    PlannerInputs,
    TransferRates,
    WeightPipeline,
    WeightPlacement,
    Workload,
    describe,
    is_better,
    layer_tiers,
    num_layer_buffers,
    pipelines_to_try,
    placement_of,
    plan_placement,
)
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.experts.hot_experts import describe_expert_cache
from scheduler.planning.slicing.plan import SlicingPlan, describe_slicing, plan_slicing

MOE_STREAMING_REFUSAL = ("whole-layer weight streaming does not take mixture-of-experts layers; to fit a "
                         "--weights-gpu-gib budget, place its experts with --mlp-slicing auto")


@dataclass(frozen=True)
class PlacementRequest:
    """What the placement planner needs besides the model: the budgets (their GPU weight
    budget is the one both planners share), the workload, the --weight-placement mode and
    --weight-pipeline, and `measure`, called only where whole layers may stream, giving this
    machine's transfer rates and compute costs."""

    budgets: MemoryBudgets
    workload: Workload
    measure: Callable[[], tuple[TransferRates, ComputeCosts]]
    mode: PlacementMode = PlacementMode.AUTO
    pipeline: WeightPipeline = WeightPipeline.AUTO

    def inputs(self, shape: ModelShape, fmt: WeightFormat) -> PlannerInputs:
        rates, costs = self.measure()
        return PlannerInputs(shape, fmt, self.workload, self.budgets, rates, costs, self.mode, self.pipeline)


@dataclass(frozen=True)
class SlicingRequest:
    """What --mlp-slicing asks: each decoder layer's fixed rates (`rates`), or rates solved
    (None) for decode batches of `num_tokens`; with the prefill token assignment for prefills of
    `prefill_tokens` (None: --mlp-prefill-moving off)."""

    costs: SlicingCosts
    num_tokens: int
    rates: tuple[SliceRates, ...] | None = None
    prefill_tokens: int | None = None


def plan_model(shape: ModelShape, fmt: WeightFormat, placement: PlacementRequest | None = None,
               slicing: SlicingRequest | None = None) -> ModelPlan:
    """Each decoder layer's tier and MLP rates within `placement`'s GPU weight budget
    (None: no budget, and no layer streams whole), sliced as `slicing` asks (None: not sliced);
    PlacementError saying what to change when nothing fits."""
    if slicing is None:
        if placement is None:
            return _all_resident(shape, fmt)
        if shape.is_moe:
            raise PlacementError(MOE_STREAMING_REFUSAL)
        return _plan_of(shape, plan_placement(placement.inputs(shape, fmt)), None,
                        placement.budgets.gpu_weight_bytes)
    if slicing.rates is not None and len(slicing.rates) != shape.num_layers:
        raise ValueError(f"{len(slicing.rates)} slice rates for {shape.num_layers} layers")
    if placement is None:
        return _every_layer_sliced(shape, fmt, slicing, None)
    budget = placement.budgets.gpu_weight_bytes
    if shape.is_moe:
        try:
            return _every_layer_sliced(shape, fmt, slicing, budget)
        except PlacementError as error:
            raise PlacementError(f"{error} (a mixture-of-experts model's layers do not stream whole: its "
                                 f"attention, routers and shared experts stay resident)") from None
    if slicing.rates is not None or placement.mode in (PlacementMode.CPU, PlacementMode.DISK):
        return _with_placement(shape, fmt, placement.inputs(shape, fmt), slicing)
    try:
        return _every_layer_sliced(shape, fmt, slicing, budget)
    except PlacementError as error:
        if placement.mode == PlacementMode.GPU:  # every layer resident: none may stream whole
            raise
        return _fewest_streamed(shape, fmt, placement.inputs(shape, fmt), slicing, str(error))


def _all_resident(shape: ModelShape, fmt: WeightFormat) -> ModelPlan:
    """Every layer resident whole: no budget, nothing sliced."""
    weight_bytes = resident_global_bytes(shape, fmt.dtype_bytes) + shape.num_layers * layer_image_bytes(shape, fmt)
    return ModelPlan((LayerPlan(Tier.GPU),) * shape.num_layers, gpu_weight_bytes=weight_bytes)


def _every_layer_sliced(shape: ModelShape, fmt: WeightFormat, slicing: SlicingRequest,
                        budget: int | None) -> ModelPlan:
    return _plan_of(shape, None, _slice(shape, fmt, slicing, budget, range(shape.num_layers), 0), budget)


def _slice(shape: ModelShape, fmt: WeightFormat, slicing: SlicingRequest, budget: int | None, layers,
           num_layer_buffers: int) -> SlicingPlan:
    layers = tuple(layers)
    rates = None if slicing.rates is None else [slicing.rates[layer] for layer in layers]
    return plan_slicing(shape, fmt, slicing.costs, budget, slicing.num_tokens, fixed_rates=rates,
                        prefill_tokens=slicing.prefill_tokens, layers=layers, num_layer_buffers=num_layer_buffers)


def _with_placement(shape: ModelShape, fmt: WeightFormat, inputs: PlannerInputs, slicing: SlicingRequest) -> ModelPlan:
    """The placement planner's tiers, its resident layers sliced (at fixed rates, or solved within
    what the budget leaves), and the placement priced again with the sliced layers' bytes."""
    placement = plan_placement(inputs)
    budget = inputs.budgets.gpu_weight_bytes
    resident = [i for i, tier in enumerate(placement.tiers) if tier == Tier.GPU]
    if not resident:
        return _plan_of(shape, placement, None, budget)
    sliced = _slice(shape, fmt, slicing, budget, resident, placement.num_buffers)
    priced = _priced(inputs, placement.tiers, placement.pipeline, placement.num_buffers, sliced)
    if isinstance(priced, str):
        raise PlacementError(f"the model's weights do not fit: {priced}")
    return _plan_of(shape, priced, sliced, budget)


def _fewest_streamed(shape: ModelShape, fmt: WeightFormat, inputs: PlannerInputs, slicing: SlicingRequest,
                     slicing_alone: str) -> ModelPlan:
    """Slicing every layer did not fit (`slicing_alone` says why): the plan streaming the fewest
    layers whole, the rest sliced within what the budget leaves beside the globals and the ring;
    of the pipelines that fit at that count, the one the placement planner prefers."""
    reasons = [slicing_alone]
    pipelines = pipelines_to_try(inputs.pipeline)
    for num_streamed in range(1, shape.num_layers + 1):
        tiers = layer_tiers(inputs, shape.num_layers - num_streamed)
        if isinstance(tiers, str):  # no room in host memory or on disk: streaming more needs more of it
            reasons.append(tiers)
            break
        best: ModelPlan | None = None
        for pipeline in pipelines:
            candidate = _joint_candidate(shape, fmt, inputs, slicing, tiers, pipeline)
            if isinstance(candidate, str):
                reasons.append(candidate)
            elif best is None or is_better(candidate.placement, best.placement):
                best = candidate
        if best is not None:
            return best
    raise PlacementError(f"the model's weights do not fit: {reasons[-1]}")


def _joint_candidate(shape: ModelShape, fmt: WeightFormat, inputs: PlannerInputs, slicing: SlicingRequest,
                     tiers: list[Tier], pipeline: str) -> ModelPlan | str:
    """These tiers' plan with the resident layers sliced, or why it does not fit."""
    resident = [i for i, tier in enumerate(tiers) if tier == Tier.GPU]
    num_buffers = num_layer_buffers(inputs.workload, shape.num_layers - len(resident), pipeline)
    budget = inputs.budgets.gpu_weight_bytes
    if not resident:  # every layer streams whole: the globals and the ring
        layer_bytes = layer_image_bytes(shape, fmt)
        global_bytes = resident_global_bytes(shape, fmt.dtype_bytes)
        if budget is not None and global_bytes + num_buffers * layer_bytes > budget:
            return (f"the GPU needs {_gib(global_bytes + num_buffers * layer_bytes)} for weights (embeddings, "
                    f"LM head and norms {_gib(global_bytes)} and {num_buffers} layer buffers of {_gib(layer_bytes)}) "
                    f"but --weights-gpu-gib gives {_gib(budget)}; give more")
        placement = placement_of(inputs, tiers, pipeline, num_buffers, 0, num_buffers * layer_bytes)
        return placement if isinstance(placement, str) else _plan_of(shape, placement, None, budget)
    try:
        sliced = _slice(shape, fmt, slicing, budget, resident, num_buffers)
    except PlacementError as error:
        return str(error)
    placement = _priced(inputs, tiers, pipeline, num_buffers, sliced)
    return placement if isinstance(placement, str) else _plan_of(shape, placement, sliced, budget)


def _priced(inputs: PlannerInputs, tiers, pipeline: str | None, num_buffers: int,
            sliced: SlicingPlan) -> WeightPlacement | str:
    """The placement of these tiers whose resident layers are `sliced`: their attention and GG
    parts are its resident bytes, the shared ring and CG''s buffer its buffers."""
    global_bytes = resident_global_bytes(inputs.shape, inputs.fmt.dtype_bytes)
    return placement_of(inputs, tiers, pipeline, num_buffers, sliced.fixed_bytes - global_bytes + sliced.resident_bytes,
                        sliced.buffer_bytes + sliced.moved_buffer_bytes)


def _plan_of(shape: ModelShape, placement: WeightPlacement | None, sliced: SlicingPlan | None,
             budget: int | None) -> ModelPlan:
    tiers = placement.tiers if placement is not None else (Tier.GPU,) * shape.num_layers
    rates = dict(zip(sliced.layers, sliced.rates)) if sliced is not None else {}
    layers = tuple(LayerPlan(Tier(tier), rates.get(i)) for i, tier in enumerate(tiers))
    if sliced is not None:
        num_buffers, buffer_bytes = sliced.num_ring_buffers, sliced.ring_buffer_bytes
        weight_bytes = sliced.gpu_weight_bytes
    else:
        num_buffers, buffer_bytes = placement.num_buffers, placement.layer_bytes if placement.num_buffers else 0
        weight_bytes = placement.memory.gpu_weight_bytes
    return ModelPlan(layers, placement, sliced, num_ring_buffers=num_buffers, ring_buffer_bytes=buffer_bytes,
                     gpu_weight_bytes=weight_bytes, budget_bytes=budget)


def _gib(num_bytes: float) -> str:
    """GiB to two places, or MiB where that would round small sizes away."""
    if num_bytes < 0.1 * GIB_BYTES:
        return f"{num_bytes / 2**20:.2f} MiB"
    return f"{num_bytes / GIB_BYTES:.2f} GiB"


# ---- reporting ------------------------------------------------------------------------------
def _letter(layer: LayerPlan) -> str:
    if layer.streamed:
        return layer.tier.value[0].upper()
    return "S" if layer.sliced else "A"


def describe_model_plan(plan: ModelPlan, offload_dir: str | None = None) -> str:
    """What `tandem plan` prints: the layer map, the GPU's weight bytes and the ring; the
    placement's memory breakdown and estimate where the placement planner ran; the sliced layers'
    rates and predicted times where MLPs are sliced."""
    num_host, num_disk = plan.num_layers_in(Tier.HOST), plan.num_layers_in(Tier.DISK)
    num_sliced = len(plan.sliced_layers)
    num_whole = len(plan.layers) - num_sliced - num_host - num_disk
    lines = [f"model plan: {len(plan.layers)} decoder layers: {num_whole} resident whole, {num_sliced} with a sliced "
             f"MLP, {num_host + num_disk} streamed whole ({num_host} from host memory, {num_disk} from disk)",
             f"  layers: {''.join(_letter(layer) for layer in plan.layers)} (A resident, S sliced, H streamed whole "
             f"from host memory, D from disk)"]
    if plan.gpu_weight_bytes is not None:
        budget = f" of the {_gib(plan.budget_bytes)} --weights-gpu-gib gives" if plan.budget_bytes is not None else ""
        ring = (f"{plan.num_ring_buffers} buffer{'s' if plan.num_ring_buffers > 1 else ''} of "
                f"{_gib(plan.ring_buffer_bytes)} that layers streamed whole and CG parts pass through"
                if plan.num_ring_buffers else "none, nothing streams")
        lines.append(f"  GPU weights {_gib(plan.gpu_weight_bytes)}{budget}; ring: {ring}")
    if plan.placement is not None:
        lines.append(describe(plan.placement, offload_dir))
    if plan.slicing is not None:
        lines.append(describe_slicing(plan.slicing))
    if plan.experts is not None:
        lines.append(describe_expert_cache(plan.experts))
    return "\n".join(lines)
