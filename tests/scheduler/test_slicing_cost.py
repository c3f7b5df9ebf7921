import random

import pytest

from scheduler.placement.slicing_cost import (
    UNIT_BYTES,
    UNIT_MULTIPLY_ADDS,
    LinearCost,
    SlicingCosts,
    fit_linear_cost,
)


def test_exact_points_give_their_line_and_r_squared_one():
    points = [(volume, 3e-6 + 2.5e-11 * volume) for volume in (1e5, 1e6, 4e6, 1.6e7)]
    cost = fit_linear_cost(points, UNIT_BYTES)
    assert cost.a_s == pytest.approx(3e-6, rel=1e-9) and cost.b_s_per_unit == pytest.approx(2.5e-11, rel=1e-9)
    assert cost.r_squared == pytest.approx(1.0) and cost.unit == UNIT_BYTES


def test_noisy_points_fit_close_with_r_squared_below_one():
    rng = random.Random(7)
    points = [(volume, (1e-5 + 4e-12 * volume) * rng.uniform(0.95, 1.05)) for volume in range(10**6, 10**8, 10**6)]
    cost = fit_linear_cost(points, UNIT_MULTIPLY_ADDS)
    assert cost.b_s_per_unit == pytest.approx(4e-12, rel=0.05)
    assert 0.9 < cost.r_squared < 1.0
    mean = sum(t for _, t in points) / len(points)
    residual = sum((t - cost.time_s(v)) ** 2 for v, t in points)
    assert cost.r_squared == pytest.approx(1 - residual / sum((t - mean) ** 2 for _, t in points))


def test_errors_count_relative_to_each_points_time():
    """A small point off the line moves the fit as much as a large one off by the same share."""
    points = [(1.0, 1.0 * 1.1), (10.0, 10.0), (100.0, 100.0), (1000.0, 1000.0 * 1.1)]
    cost = fit_linear_cost(points, UNIT_BYTES)
    relative = [cost.time_s(v) / t - 1 for v, t in points]
    assert abs(relative[0]) < 0.1 and abs(relative[-1]) < 0.1


def test_a_fit_never_predicts_negative_times():
    points = [(1.0, 3.0), (2.0, 2.0), (3.0, 1.5)]
    falling = fit_linear_cost(points, UNIT_BYTES)
    # the flat line nearest in relative terms: sum(1/t) / sum(1/t^2)
    assert falling.b_s_per_unit == 0.0
    assert falling.a_s == pytest.approx(sum(1 / t for _, t in points) / sum(1 / t ** 2 for _, t in points))
    points = [(1.0, 0.5), (2.0, 2.0), (3.0, 3.5)]
    below_origin = fit_linear_cost(points, UNIT_BYTES)
    # through the origin: sum(v/t) / sum(v^2/t^2)
    assert below_origin.a_s == 0.0
    assert below_origin.b_s_per_unit == pytest.approx(sum(v / t for v, t in points) / sum((v / t) ** 2 for v, t in points))


@pytest.mark.parametrize("points,field", [([(1.0, 1.0)], "points"), ([(1.0, 1.0), (1.0, 2.0)], "points"),
                                          ([(1.0, 0.0), (2.0, 1.0)], "points")])
def test_unfittable_points_are_refused(points, field):
    with pytest.raises(ValueError, match=field):
        fit_linear_cost(points, UNIT_BYTES)


def test_costs_check_units_and_round_trip_through_a_dict():
    gemm = LinearCost(1e-6, 3e-12, UNIT_MULTIPLY_ADDS, 0.99)
    link = LinearCost(5e-6, 2e-11, UNIT_BYTES)
    costs = SlicingCosts(gemm, gemm, link, 4e-5)
    assert SlicingCosts.from_dict(costs.to_dict()) == costs
    with pytest.raises(ValueError, match="link"):
        SlicingCosts(gemm, gemm, gemm, 4e-5)
    with pytest.raises(ValueError, match="launch_s"):
        SlicingCosts(gemm, gemm, link, -1.0)
