"""The joint planner (scheduler/planning/model_plan.py): whole-layer streaming and MLP slicing
decided together within one weight budget, as one ModelPlan. No torch."""
import dataclasses

import pytest
from test_placement import GLOBALS, LAYER, SHAPE, WORKLOAD, inputs
from test_slicing_plan import MOE_SHAPE

from scheduler.planning import (
    GIB_BYTES,
    GemmCost,
    LinearCost,
    MemoryBudgets,
    PlacementError,
    PlacementRequest,
    SliceRates,
    SlicingCosts,
    SlicingRequest,
    Tier,
    WeightFormat,
    describe_model_plan,
    layer_image_bytes,
    plan_model,
    plan_placement,
    ring_size,
)
from scheduler.planning.placement import layer_tiers
from scheduler.planning.slicing.rates import NUM_CG_BUFFERS
from scheduler.planning.slicing.cost import UNIT_BYTES
from scheduler.planning.slicing.plan import fixed_weight_bytes, layer_works

BF16 = WeightFormat("none", 2)
ATTENTION = fixed_weight_bytes(SHAPE, BF16, [0]) - GLOBALS  # one layer's attention weights
MLP = layer_works(SHAPE, BF16, 1)[0].weight_bytes
# the paper's testbed A: the GPU computes 5x faster than the CPU
COSTS = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                     4.4e-5)


def _never():
    raise AssertionError("measured, though no layer may stream whole")


def request(budgets: MemoryBudgets, mode: str = "auto", pipeline: str = "auto", measured: bool = True,
            shape=SHAPE, **kwargs) -> PlacementRequest:
    """The placement planner's request; `measured` False: measuring fails the test."""
    base = dataclasses.replace(inputs(budgets, mode=mode, pipeline=pipeline, **kwargs), shape=shape)
    measure = (lambda: (base.rates, base.costs)) if measured else _never
    return PlacementRequest(budgets, base.workload, measure, mode, pipeline)


def sliced(rates: SliceRates | None = None, num_tokens: int = 16, shape=SHAPE) -> SlicingRequest:
    return SlicingRequest(COSTS, num_tokens, None if rates is None else (rates,) * shape.num_layers)


def budgets(weight_bytes: int, **kwargs) -> MemoryBudgets:
    return MemoryBudgets(gpu_weight_bytes=weight_bytes, kv_cache_bytes=GIB_BYTES, **kwargs)


def test_auto_slicing_that_fits_slices_every_layer_and_streams_none():
    budget = fixed_weight_bytes(SHAPE, BF16) + 4 * MLP
    plan = plan_model(SHAPE, BF16, request(budgets(budget), measured=False), sliced())
    assert plan.streamed_layers == () and plan.placement is None
    assert all(layer.tier == Tier.GPU and layer.rates is not None for layer in plan.layers)
    assert plan.slicing.layers == tuple(range(SHAPE.num_layers))
    assert plan.gpu_weight_bytes == plan.slicing.gpu_weight_bytes <= budget


def test_a_budget_too_small_for_slicing_alone_streams_the_fewest_layers_spread_and_slices_the_rest():
    """Streaming a layer whole saves its attention (1/5.8 of a layer) but takes a layer buffer:
    with room for the globals, one buffer and 8.5 layers' attention, eight layers stream (through
    one buffer: the memory-efficient pipeline), spread, first in host memory while it lasts, then
    on disk; the other eight are sliced within what is left."""
    budget = GLOBALS + LAYER + 8 * ATTENTION + ATTENTION // 2
    limits = budgets(budget, host_weight_bytes=3 * LAYER, disk_bytes=50 * GIB_BYTES, has_offload_dir=True)
    plan = plan_model(SHAPE, BF16, request(limits), sliced())
    assert len(plan.streamed_layers) == 8 and plan.slicing.layers == tuple(range(1, 16, 2))
    assert plan.tiers == tuple(layer_tiers(inputs(limits), 8))  # spread, host then disk, as the placement planner
    assert plan.num_layers_in(Tier.HOST) == 1 and plan.num_layers_in(Tier.DISK) == 7
    assert plan.placement.num_buffers == 1 and plan.placement.pipeline == "memory"
    assert all((layer.rates is None) == layer.streamed for layer in plan.layers)
    assert plan.gpu_weight_bytes <= budget
    assert plan.placement.memory.gpu_weight_bytes == plan.gpu_weight_bytes
    assert (plan.num_ring_buffers, plan.ring_buffer_bytes) == ring_size(
        plan.placement.num_buffers, LAYER, max(round(r.cg * MLP) for r in plan.slicing.rates))
    one_fewer = fixed_weight_bytes(SHAPE, BF16, [i for i, tier in enumerate(layer_tiers(inputs(limits), 9))
                                                 if tier == Tier.GPU])
    assert one_fewer + LAYER > budget  # seven streamed layers leave no room beside one buffer


def test_a_roomier_budget_streams_fewer_layers():
    tight = plan_model(SHAPE, BF16, request(budgets(GLOBALS + LAYER + 9 * ATTENTION)), sliced())
    roomy_budget = GLOBALS + LAYER + 10 * ATTENTION
    roomy = plan_model(SHAPE, BF16, request(budgets(roomy_budget)), sliced())
    assert len(tight.streamed_layers) == 7 and len(roomy.streamed_layers) == 6
    assert roomy.gpu_weight_bytes <= roomy_budget


def test_cg_parts_share_the_ring_of_the_layers_streamed_whole():
    """Two-batch forwards under the performance pipeline stream whole layers through three buffers
    of a layer image: CG parts (each smaller) pass through the same ring at no extra cost."""
    shape = dataclasses.replace(SHAPE, intermediate_size=1024)  # layers of 1.6 layers' attention
    layer, attention = layer_image_bytes(shape, BF16), fixed_weight_bytes(shape, BF16, [0]) - GLOBALS
    budget = GLOBALS + 15 * attention  # not every layer's attention: ten sliced beside three layer buffers
    work = dataclasses.replace(WORKLOAD, layers_in_use=2)
    plan = plan_model(shape, BF16, request(budgets(budget), pipeline="performance", shape=shape, workload=work),
                      sliced(shape=shape))
    assert len(plan.streamed_layers) == 6 and plan.placement.num_buffers == NUM_CG_BUFFERS
    assert any(r.cg > 0 for r in plan.slicing.rates)
    assert (plan.num_ring_buffers, plan.ring_buffer_bytes) == (NUM_CG_BUFFERS, layer)
    expected = (fixed_weight_bytes(shape, BF16, plan.slicing.layers) + NUM_CG_BUFFERS * layer
                + plan.slicing.resident_bytes + plan.slicing.moved_buffer_bytes)
    assert plan.gpu_weight_bytes == expected <= budget


def test_fixed_rates_compose_with_the_placement():
    limits = budgets(GLOBALS + 10 * LAYER)
    placement = plan_placement(inputs(limits))
    rates = SliceRates(0.25, 0.5, 0.25)
    plan = plan_model(SHAPE, BF16, request(limits), sliced(rates))
    assert plan.tiers == placement.tiers and plan.streamed_layers
    assert all(layer.rates == (None if layer.streamed else rates) for layer in plan.layers)
    assert plan.num_ring_buffers == max(placement.num_buffers, NUM_CG_BUFFERS) and plan.ring_buffer_bytes == LAYER
    assert plan.gpu_weight_bytes == plan.placement.memory.gpu_weight_bytes <= GLOBALS + 10 * LAYER


def test_fixed_rates_without_a_budget_slice_every_layer_unmeasured():
    rates = SliceRates(0.5, 0.25, 0.25)
    plan = plan_model(SHAPE, BF16, None, sliced(rates))
    assert plan.rates == (rates,) * SHAPE.num_layers and plan.placement is None
    assert plan.num_ring_buffers == NUM_CG_BUFFERS and plan.ring_buffer_bytes == round(0.25 * MLP)


def test_slicing_off_is_the_placement_planners_plan():
    limits = budgets(GLOBALS + 10 * LAYER)
    plan = plan_model(SHAPE, BF16, request(limits))
    placement = plan_placement(inputs(limits))
    assert plan.placement == placement and plan.tiers == placement.tiers and plan.rates is None
    assert (plan.num_ring_buffers, plan.ring_buffer_bytes) == (placement.num_buffers, LAYER)
    assert plan.gpu_weight_bytes == placement.memory.gpu_weight_bytes
    resident = plan_model(SHAPE, BF16)
    assert resident.all_resident and resident.placement is None and resident.num_ring_buffers == 0
    assert resident.gpu_weight_bytes == GLOBALS + SHAPE.num_layers * LAYER


def test_a_moe_model_that_does_not_fit_sliced_is_refused_not_streamed():
    fmt = WeightFormat("none", 2)
    limits = budgets(fixed_weight_bytes(MOE_SHAPE, fmt) - 1)
    with pytest.raises(PlacementError, match="mixture-of-experts .* do not stream whole.*--weights-gpu-gib|"
                                             "--weights-gpu-gib.*mixture-of-experts .* do not stream whole"):
        plan_model(MOE_SHAPE, fmt, request(limits, measured=False), sliced(shape=MOE_SHAPE))
    with pytest.raises(PlacementError, match="does not take mixture-of-experts layers.*--mlp-slicing auto"):
        plan_model(MOE_SHAPE, fmt, request(limits, measured=False))


def test_a_budget_below_the_globals_is_refused_naming_the_flag():
    limits = budgets(GLOBALS - 1, host_weight_bytes=20 * LAYER)
    with pytest.raises(PlacementError, match="do not fit: .*--weights-gpu-gib gives"):
        plan_model(SHAPE, BF16, request(limits), sliced())


def test_describe_and_to_dict_show_both_parts():
    plan = plan_model(SHAPE, BF16, request(budgets(GLOBALS + LAYER + 10 * ATTENTION)), sliced())
    text = describe_model_plan(plan)
    assert "layers: " + "".join("H" if layer.streamed else "S" for layer in plan.layers) in text
    assert "weight placement (auto)" in text and "MLP slicing (ScheInfer)" in text and "ring: 1 buffer of" in text
    report = plan.to_dict()
    assert [layer["tier"] for layer in report["layers"]] == [str(tier) for tier in plan.tiers]
    assert report["ring"] == {"num_buffers": plan.num_ring_buffers, "buffer_bytes": plan.ring_buffer_bytes}
    assert report["slicing"]["layers"] == list(plan.slicing.layers) and "placement" in report


def test_a_placement_request_keeps_its_mode():
    limits = budgets(GLOBALS + 4 * LAYER)
    plan = plan_model(SHAPE, BF16, request(limits, mode="cpu"), sliced())
    assert plan.tiers == (Tier.HOST,) * SHAPE.num_layers and plan.slicing is None
    with pytest.raises(PlacementError, match="--weights-gpu-gib"):
        plan_model(SHAPE, BF16, request(dataclasses.replace(limits, gpu_weight_bytes=GLOBALS), mode="gpu",
                                        measured=False), sliced())
