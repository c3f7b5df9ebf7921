import random

import pytest
from test_slicing_model import random_costs

from scheduler.planning.cost_model import ModelShape
from scheduler.planning import (
    PlacementError,
    GemmCost,
    LinearCost,
    MlpSlicing,
    SliceRates,
    SlicingCosts,
    SlicingMode,
    WeightFormat,
    describe_slicing,
    layer_time_s,
    plan_slicing,
    solve_moved_tokens,
)
from scheduler.planning.slicing.cost import UNIT_BYTES
from scheduler.planning.slicing.rates import NUM_CG_BUFFERS
from scheduler.planning.slicing.plan import fixed_weight_bytes, layer_works

SHAPE = ModelShape(num_layers=6, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2, head_dim=64,
                   vocab_size=1000)
FMT = WeightFormat("none", 2)


def _bytes(num_resident_mlps: float) -> int:
    """A budget: what slicing always keeps resident, one MLP's buffer, and this many MLPs more."""
    mlp = layer_works(SHAPE, FMT, 1)[0].weight_bytes
    return fixed_weight_bytes(SHAPE, FMT) + mlp + round(num_resident_mlps * mlp)


@pytest.mark.parametrize("value,expected", [
    ("off", MlpSlicing()), ("AUTO", MlpSlicing(SlicingMode.AUTO)),
    ("0.25,0.5", MlpSlicing(SlicingMode.FIXED, (SliceRates(0.25, 0.5, 0.25),))),
    ("0,1", MlpSlicing(SlicingMode.FIXED, (SliceRates(0.0, 1.0, 0.0),))),
    (SliceRates(0.5, 0.5, 0.0), MlpSlicing(SlicingMode.FIXED, (SliceRates(0.5, 0.5, 0.0),))),
])
def test_the_flag_parses_into_a_typed_value(value, expected):
    slicing = MlpSlicing.parse(value)
    assert slicing == expected and MlpSlicing.parse(slicing) is slicing
    assert slicing.enabled == (expected.mode != SlicingMode.OFF) and slicing.solved == (expected.mode == SlicingMode.AUTO)


def test_fixed_rates_apply_to_every_layer_or_one_per_layer():
    per_layer = (SliceRates(1.0, 0.0, 0.0), SliceRates(0.0, 0.5, 0.5))
    assert MlpSlicing.parse("0.25,0.5").layer_rates(3) == (SliceRates(0.25, 0.5, 0.25),) * 3
    assert MlpSlicing.parse(per_layer).layer_rates(2) == per_layer and str(MlpSlicing.parse(per_layer)) == "1,0;0,0.5"
    assert MlpSlicing.parse("auto").layer_rates(2) is None and str(MlpSlicing.parse("0.25,0.5")) == "0.25,0.5"
    with pytest.raises(ValueError, match="slice rates for 2 layers, but the model has 3"):
        MlpSlicing.parse(per_layer).layer_rates(3)


@pytest.mark.parametrize("value", ["half", "0.7,0.5", "0.5", "-0.1,0.5", [0.25, 0.5], ()])
def test_a_bad_value_says_what_the_flag_takes(value):
    with pytest.raises(ValueError, match="must be off, auto"):
        MlpSlicing.parse(value)


def test_solved_plans_fit_their_budget_and_predict_their_rates_times():
    rng = random.Random(21)
    for _ in range(30):
        costs = random_costs(rng)
        budget = _bytes(rng.uniform(0.0, SHAPE.num_layers + 1))
        num_tokens = rng.choice([1, 4, 32])
        plan = plan_slicing(SHAPE, FMT, costs, budget, num_tokens)
        assert plan.gpu_weight_bytes <= budget and len(plan.rates) == SHAPE.num_layers
        work = layer_works(SHAPE, FMT, num_tokens)[0]
        for rates, time_s in zip(plan.rates, plan.layer_time_s):
            assert time_s == pytest.approx(layer_time_s(work, costs, rates))
        assert plan.resident_bytes == sum(round(r.gg * plan.mlp_bytes) for r in plan.rates)
        largest_cg = max(round(r.cg * plan.mlp_bytes) for r in plan.rates)
        assert plan.buffer_bytes == (NUM_CG_BUFFERS * largest_cg if any(r.gg < 1 for r in plan.rates) else 0)


def test_a_bigger_budget_keeps_more_resident_when_the_gpu_is_fast():
    """The paper's testbed A (its Table's FP16 models): the GPU computes 5x faster than the
    CPU, so at a batch of 64 (launches no longer dominate) every resident byte saves time."""
    costs = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                         4.4e-5)
    small, large = (plan_slicing(SHAPE, FMT, costs, _bytes(n), 64) for n in (1.0, 4.0))
    assert small.resident_bytes < large.resident_bytes
    assert sum(large.layer_time_s) < sum(small.layer_time_s)


def test_everything_resident_needs_no_buffer():
    plan = plan_slicing(SHAPE, FMT, random_costs(random.Random(2)), _bytes(SHAPE.num_layers - 1), 1,
                        fixed_rates=SliceRates.resident())
    assert plan.buffer_bytes == 0 and plan.gpu_weight_bytes == _bytes(SHAPE.num_layers - 1)


def test_unbounded_takes_each_layers_fastest_rates():
    costs = random_costs(random.Random(8))
    plan = plan_slicing(SHAPE, FMT, costs, None, 4)
    bounded = plan_slicing(SHAPE, FMT, costs, _bytes(2.0), 4)
    assert sum(plan.layer_time_s) <= sum(bounded.layer_time_s)


def test_a_budget_without_room_for_the_fixed_weights_is_refused_with_the_flag_to_change():
    with pytest.raises(PlacementError, match="--weights-gpu-gib"):
        plan_slicing(SHAPE, FMT, random_costs(random.Random(1)), fixed_weight_bytes(SHAPE, FMT) - 1, 1)
    with pytest.raises(PlacementError, match="--weights-gpu-gib"):
        plan_slicing(SHAPE, FMT, random_costs(random.Random(1)), _bytes(1.0), 1, fixed_rates=SliceRates(0.0, 0.0, 1.0))


def test_a_budget_with_no_room_for_buffers_computes_the_mlps_on_the_cpu():
    plan = plan_slicing(SHAPE, FMT, random_costs(random.Random(1)), fixed_weight_bytes(SHAPE, FMT), 1)
    assert set(plan.rates) == {SliceRates(1.0, 0.0, 0.0)} and plan.buffer_bytes == 0


def test_fixed_rates_everywhere_and_the_prefills_moved_tokens():
    costs = random_costs(random.Random(6))
    rates = SliceRates(0.5, 0.25, 0.25)
    plan = plan_slicing(SHAPE, FMT, costs, None, 2, fixed_rates=rates, prefill_tokens=256)
    assert set(plan.rates) == {rates}
    expected = solve_moved_tokens(layer_works(SHAPE, FMT, 256)[0], costs, rates)
    assert plan.moved_tokens == (expected[0],) * SHAPE.num_layers
    assert plan.prefill_time_s == (expected[1],) * SHAPE.num_layers


def test_plans_with_prefill_moves_keep_room_for_cg_primes_buffer_within_their_budget():
    rng = random.Random(22)
    for _ in range(8):
        costs = random_costs(rng)
        budget = _bytes(rng.uniform(0.0, SHAPE.num_layers + 1))
        try:
            plan = plan_slicing(SHAPE, FMT, costs, budget, rng.choice([1, 4, 32]), prefill_tokens=256)
        except PlacementError:
            continue
        assert plan.gpu_weight_bytes <= budget
        largest_cc = max(round(r.cc * plan.mlp_bytes) for r in plan.rates)
        if plan.moved_buffer_bytes:
            assert plan.moved_buffer_bytes == largest_cc
        else:  # no room for it: nothing moves
            assert set(plan.moved_tokens) <= {0}


def test_a_budget_with_no_room_for_cg_primes_buffer_moves_no_tokens():
    costs = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                         4.4e-5)  # testbed A: a prefill would move tokens if it could
    roomy = plan_slicing(SHAPE, FMT, costs, None, 1, fixed_rates=SliceRates(1.0, 0.0, 0.0), prefill_tokens=512)
    assert roomy.moved_buffer_bytes == roomy.mlp_bytes and max(roomy.moved_tokens) > 0
    tight = plan_slicing(SHAPE, FMT, costs, fixed_weight_bytes(SHAPE, FMT), 1, prefill_tokens=512)
    assert set(tight.rates) == {SliceRates(1.0, 0.0, 0.0)} and tight.moved_buffer_bytes == 0
    assert set(tight.moved_tokens) == {0}


def test_describe_prints_runs_of_equal_layers():
    costs = random_costs(random.Random(6))
    text = describe_slicing(plan_slicing(SHAPE, FMT, costs, None, 2, fixed_rates=SliceRates(0.5, 0.25, 0.25),
                                         prefill_tokens=64))
    assert "layers 0-5" in text and "CC 0.500  CG 0.250  GG 0.250" in text and "prefill of 64" in text


# Qwen3-MoE-like: 16 experts of width 256, top-4, layer 1 dense
MOE_SHAPE = ModelShape(num_layers=4, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=2, head_dim=64,
                       vocab_size=1000, num_experts=16, num_experts_per_token=4, expert_intermediate_size=256,
                       dense_mlp_layers=(1,))


def test_moe_layers_are_sliced_by_whole_experts_and_dense_layers_by_units():
    rng = random.Random(5)
    works = layer_works(MOE_SHAPE, FMT, 4)
    assert [work.num_experts for work in works] == [16, 0, 16, 16]
    expert_bytes = works[0].weight_bytes // 16
    fixed = fixed_weight_bytes(MOE_SHAPE, FMT)
    for _ in range(20):
        costs = random_costs(rng)
        budget = fixed + rng.randint(0, 5) * expert_bytes * 16
        try:
            plan = plan_slicing(MOE_SHAPE, FMT, costs, budget, rng.choice([1, 4, 16]))
        except PlacementError:
            continue
        assert plan.gpu_weight_bytes <= budget
        for layer, rates in enumerate(plan.rates):
            if layer != 1:
                for rate in (rates.cc, rates.cg, rates.gg):
                    assert rate * 16 == pytest.approx(round(rate * 16))


def test_moe_routers_stay_resident_in_the_fixed_bytes():
    dense_only = ModelShape(**{**MOE_SHAPE.__dict__, "dense_mlp_layers": (0, 1, 2, 3)})
    router = 16 * 512 * 2  # [experts, hidden], always dense
    assert fixed_weight_bytes(MOE_SHAPE, FMT) - fixed_weight_bytes(dense_only, FMT) == 3 * router
