import random

import pytest

from scheduler.planning.slicing.cost import (
    UNIT_BYTES,
    GemmCost,
    LinearCost,
    SlicingCosts,
    fit_gemm_cost,
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
    cost = fit_linear_cost(points, "multiply-adds")
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


def test_gemm_costs_recover_startup_compute_and_weight_bytes():
    true = GemmCost(2e-5, 3e-11, 5e-11)
    points = [(n * o * i, o * i * 2, true.time_s(n * o * i, o * i * 2))
              for n in (1, 4, 16, 64) for o, i in ((512, 2048), (2048, 512), (4096, 4096))]
    cost = fit_gemm_cost(points)
    assert cost.a_s == pytest.approx(true.a_s, rel=1e-6)
    assert cost.b_s_per_multiply_add == pytest.approx(true.b_s_per_multiply_add, rel=1e-6)
    assert cost.b_s_per_weight_byte == pytest.approx(true.b_s_per_weight_byte, rel=1e-6)
    assert cost.r_squared == pytest.approx(1.0)


def test_gemm_costs_stay_non_negative_and_fit_collinear_volumes():
    """At one token count multiply-adds and bytes grow together: either may carry the slope."""
    points = [(o * i, o * i * 2, 1e-5 + 1e-10 * o * i) for o, i in ((512, 2048), (2048, 512), (4096, 4096))]
    cost = fit_gemm_cost(points)
    assert min(cost.a_s, cost.b_s_per_multiply_add, cost.b_s_per_weight_byte) >= 0
    for macs, nbytes, t in points:
        assert cost.time_s(macs, nbytes) == pytest.approx(t, rel=1e-6)
    rng = random.Random(3)
    noisy = [(m, b, t * rng.uniform(0.7, 1.3)) for m, b, t in points * 4]
    fitted = fit_gemm_cost(noisy)
    assert min(fitted.a_s, fitted.b_s_per_multiply_add, fitted.b_s_per_weight_byte) >= 0


def test_costs_check_units_and_round_trip_through_a_dict():
    gemm = GemmCost(1e-6, 3e-12, 1e-11, 0.99)
    link = LinearCost(5e-6, 2e-11, UNIT_BYTES)
    costs = SlicingCosts(gemm, gemm, link, 4e-5)
    assert SlicingCosts.from_dict(costs.to_dict()) == costs
    with pytest.raises(ValueError, match="link"):
        SlicingCosts(gemm, gemm, LinearCost(5e-6, 2e-11, "multiply-adds"), 4e-5)
    with pytest.raises(ValueError, match="launch_s"):
        SlicingCosts(gemm, gemm, link, -1.0)
    with pytest.raises(ValueError, match="b_s_per_weight_byte"):
        GemmCost(1e-6, 3e-12, -1.0)
    with pytest.raises(ValueError, match="cpu_gemm_slowdown"):
        SlicingCosts(gemm, gemm, link, 4e-5, cpu_gemm_slowdown=0.5)
