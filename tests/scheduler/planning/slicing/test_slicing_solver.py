import itertools
import random

import pytest
from test_slicing_model import random_costs, random_work

from scheduler.planning.memory import WeightFormat
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import UNIT_BYTES, GemmCost, LinearCost, SlicingCosts
from scheduler.planning.slicing.model import Affine, SliceTerms, dense_mlp_work, layer_pieces, layer_time_s
from scheduler.planning.slicing.solver import (
    LayerChoices,
    assign_gg,
    layer_choices,
    solve_cc,
    solve_moved_tokens,
)

NUM_GRID_STEPS = 500
GG_EIGHTHS = [i / 8 for i in range(9)]


def _max_slope(work, costs, gg: float) -> float:
    """How fast the time can change with the CC rate inside (0, 1 - gg): the grid's resolution."""
    terms = SliceTerms(Affine(0.0, 1.0), Affine(1.0 - gg, -1.0), Affine(gg), Affine(0.0), True, True, gg > 0, False)
    return max(abs(line.slope) for line in layer_pieces(work, costs, terms).lines)


@pytest.mark.parametrize("seed", range(4))
def test_edge_points_match_a_brute_force_search_over_rates(seed):
    rng = random.Random(seed)
    for _ in range(40):
        work, costs = random_work(rng), random_costs(rng, fixed_costs=rng.random() < 0.8)
        gg = rng.choice([0.0, 0.5, 1.0, round(rng.random(), 3)])
        if work.num_experts:  # whole experts: the brute force tries every count
            gg = round(gg * work.num_experts) / work.num_experts
        free = 1.0 - gg
        solved = solve_cc(work, costs, gg)
        if work.num_experts:
            grid = [k / work.num_experts for k in range(round(free * work.num_experts) + 1)]
        else:
            grid = [min(free, free * k / NUM_GRID_STEPS) for k in range(NUM_GRID_STEPS + 1)]
        brute = min(layer_time_s(work, costs, SliceRates(cc, max(0.0, free - cc), gg)) for cc in grid)
        assert solved.time_s <= brute * (1 + 1e-12)
        if work.num_experts:
            assert solved.time_s == pytest.approx(brute, rel=1e-12)
            assert solved.rates.cc * work.num_experts == pytest.approx(round(solved.rates.cc * work.num_experts))
        elif free > 0:
            assert brute - solved.time_s <= _max_slope(work, costs, gg) * free / NUM_GRID_STEPS * (1 + 1e-9)
        assert solved.rates.gg == gg
        assert solved.time_s == pytest.approx(layer_time_s(work, costs, solved.rates), rel=1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_a_cap_on_cg_is_kept_and_matches_a_brute_force_search(seed):
    rng = random.Random(50 + seed)
    for _ in range(40):
        work, costs = random_work(rng), random_costs(rng)
        num_units = work.num_experts or NUM_GRID_STEPS
        gg, max_cg = rng.randint(0, num_units) / num_units, rng.randint(0, num_units) / num_units
        free = 1.0 - gg
        solved = solve_cc(work, costs, gg, max_cg=max_cg)
        assert solved.rates.cg <= max_cg + 1e-12
        grid = [k / num_units for k in range(round(free * num_units) + 1) if free - k / num_units <= max_cg + 1e-12]
        brute = min(layer_time_s(work, costs, SliceRates(cc, max(0.0, free - cc), gg)) for cc in grid)
        assert solved.time_s <= brute * (1 + 1e-12)
        if work.num_experts:
            assert solved.time_s == pytest.approx(brute, rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_moved_tokens_match_every_count(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        work = random_work(rng, num_tokens=rng.choice([2, 17, 128, 300]))
        costs = random_costs(rng)
        rates = solve_cc(random_work(rng, num_tokens=1), costs, rng.choice([0.0, 0.25, 0.5])).rates
        rates = rng.choice([rates, SliceRates(0.5, 0.25, 0.25), SliceRates(1.0, 0.0, 0.0)])
        count, time_s = solve_moved_tokens(work, costs, rates)
        brute = min(layer_time_s(work, costs, rates, moved) for moved in range(work.num_tokens + 1))
        assert time_s == pytest.approx(brute, rel=1e-12)
        assert time_s == pytest.approx(layer_time_s(work, costs, rates, count), rel=1e-12)


def test_moving_tokens_pays_when_the_cpu_is_the_bottleneck():
    """A 512-token prefill at decode-like rates on the paper's testbed A (FP16 models of its Table):
    the CPU's share of the tokens dwarfs the rest, so tokens move, but not all of them."""
    costs = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                         4.4e-5)
    prefill = dense_mlp_work(4096, 11008, 512, WeightFormat("none", 2))
    rates = SliceRates(0.6, 0.2, 0.2)
    count, time_s = solve_moved_tokens(prefill, costs, rates)
    assert 0 < count < 512
    assert time_s < layer_time_s(prefill, costs, rates)


def _rows_work(rng: random.Random):
    """A random MLP cut by rows, without fixed costs (whole experts make an integer program)."""
    while True:
        work = random_work(rng, fixed_costs=False)
        if not work.num_experts:
            return work


def _gg_curve(work, costs, num_points: int) -> list[float]:
    return [solve_cc(work, costs, i / (num_points - 1)).time_s for i in range(num_points)]


def test_time_is_convex_in_gg_without_fixed_costs():
    """min over cc of a maximum of functions linear in (cc, gg) is convex in gg: what makes the
    greedy exact. It holds while no part's startup, launch or hop appears or vanishes, and for
    rates cut by rows (whole experts are an integer program)."""
    rng = random.Random(3)
    for _ in range(100):
        work, costs = _rows_work(rng), random_costs(rng, fixed_costs=False)
        times = _gg_curve(work, costs, 33)
        steps = [b - a for a, b in zip(times, times[1:])]
        assert all(later >= earlier - 1e-9 * times[0] for earlier, later in zip(steps, steps[1:]))


def test_fixed_costs_can_make_the_time_non_convex_in_gg():
    """Why the greedy takes any larger candidate, not only the next: with launches and startups a
    layer's time can fall faster after a step than at it."""
    rng = random.Random(3)
    found = 0
    for _ in range(100):
        times = _gg_curve(random_work(rng), random_costs(rng), 9)
        steps = [b - a for a, b in zip(times, times[1:])]
        found += any(later < earlier - 1e-9 * times[0] for earlier, later in zip(steps, steps[1:]))
    assert found > 0


def _exhaustive(layers: list[LayerChoices], budget_bytes: int) -> float:
    best = float("inf")
    for choice in itertools.product(*(range(len(layer.solved)) for layer in layers)):
        if sum(layer.resident_bytes[c] for layer, c in zip(layers, choice)) <= budget_bytes:
            best = min(best, sum(layer.solved[c].time_s for layer, c in zip(layers, choice)))
    return best


def _total(layers: list[LayerChoices], chosen: list[int]) -> tuple[float, int]:
    return (sum(layer.solved[c].time_s for layer, c in zip(layers, chosen)),
            sum(layer.resident_bytes[c] for layer, c in zip(layers, chosen)))


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_the_exhaustive_optimum_on_the_models_curves(seed):
    """Layers of one shape (equal memory steps) with their own measured costs (as layers of different
    formats would have), without fixed costs so each curve is convex; every budget in steps."""
    rng = random.Random(200 + seed)
    for _ in range(6):
        num_layers = rng.choice([2, 3, 4])
        work = _rows_work(rng)
        layers = [layer_choices(work, random_costs(rng, fixed_costs=False), GG_EIGHTHS[::2]) for _ in range(num_layers)]
        step = layers[0].resident_bytes[1]
        for num_steps in range(4 * num_layers + 1):
            chosen = assign_gg(layers, num_steps * step)
            time_s, used = _total(layers, chosen)
            assert used <= num_steps * step
            assert time_s == pytest.approx(_exhaustive(layers, num_steps * step), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_never_exceeds_the_budget_and_never_slows_a_layer(seed):
    rng = random.Random(300 + seed)
    for _ in range(20):
        layers = [layer_choices(random_work(rng), random_costs(rng), GG_EIGHTHS) for _ in range(rng.choice([1, 3, 6]))]
        budget = rng.randrange(0, sum(layer.resident_bytes[-1] for layer in layers) + 2)
        chosen = assign_gg(layers, budget)
        time_s, used = _total(layers, chosen)
        assert used <= budget
        assert all(layer.solved[c].time_s <= layer.solved[0].time_s for layer, c in zip(layers, chosen))


def test_bad_inputs_are_refused():
    rng = random.Random(1)
    work, costs = random_work(rng), random_costs(rng)
    with pytest.raises(ValueError, match="gg"):
        solve_cc(work, costs, 1.5)
    layers = [layer_choices(work, costs, GG_EIGHTHS)]
    with pytest.raises(ValueError, match="budget_bytes"):
        assign_gg(layers, -1)
    with pytest.raises(ValueError, match="resident_bytes"):
        LayerChoices(layers[0].solved[:2], (10, 5))
