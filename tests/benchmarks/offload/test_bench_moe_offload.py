"""benchmarks/offload/moe_offload.py without building an engine: the skewed router keeps the model router's
top-k and renormalisation, routes by its popularity order and switches order at run time; the
popularity shift's summary; the recorded table (docs/benchmarks.md's moe_offload block)."""
import json

import pytest
import torch

from benchmarks.offload.moe_offload import RESULTS, SkewedRouter, popularity_order, shift_summary, to_markdown
from engine.model.moe import TopKRouter
from scheduler.planning.experts.hot_experts import zipf_popularity

CPU = torch.device("cpu")


class MatrixGate:
    """A dense LinearWeight's apply: x @ weight.T."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # [num_experts, hidden]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


@pytest.mark.parametrize("normalize", [True, False])
def test_a_uniform_popularity_routes_as_the_models_router(normalize):
    generator = torch.Generator().manual_seed(0)
    router = TopKRouter(MatrixGate(torch.randn(8, 16, generator=generator)), 2, normalize)
    skewed = SkewedRouter(router, [1 / 8] * 8, [list(range(8))] * 2, CPU)
    x = torch.randn(5, 16, generator=generator)
    expected, routed = router.route(x), skewed.route(x)
    assert torch.equal(routed.expert_ids, expected.expert_ids)
    torch.testing.assert_close(routed.weights, expected.weights)


def test_a_skewed_router_follows_its_popularity_order_and_switches_order():
    orders = [popularity_order(8, 0, 3, 0), popularity_order(8, 0, 3, 1)]
    skewed = SkewedRouter(TopKRouter(MatrixGate(torch.zeros(8, 16)), 2, True), zipf_popularity(8, 1.0), orders, CPU)
    x = torch.randn(4, 16)
    routing = skewed.route(x)
    assert routing.expert_ids.tolist() == [orders[0][:2]] * 4  # a gate without preference: the prior decides
    torch.testing.assert_close(routing.weights, torch.tensor([[2 / 3, 1 / 3]] * 4))  # p1 / (p1 + p2), renormalised
    assert skewed.share_to(orders[0][:2]) == (8, 8)
    skewed.phase = 1
    assert skewed.route(x).expert_ids.tolist() == [orders[1][:2]] * 4
    assert skewed.share_to(orders[1][:2]) == (8, 16)


def test_popularity_orders_are_seeded_permutations_per_layer_and_phase():
    order = popularity_order(32, 0, 0, 0)
    assert sorted(order) == list(range(32)) and order != list(range(32))
    assert order == popularity_order(32, 0, 0, 0)
    assert order != popularity_order(32, 0, 1, 0) and order != popularity_order(32, 0, 0, 1)


def test_the_shift_summary_reads_the_pre_shift_rate_the_lowest_and_the_recovery():
    rates = [(64, 0, 0.8), (128, 0, 0.8), (192, 1, 0.3), (256, 1, 0.6), (320, 1, 0.75), (384, 1, 0.8)]
    intervals = [{"end_tokens": tokens, "phase": phase, "hit_rate": rate} for tokens, phase, rate in rates]
    assert shift_summary(intervals, 128) == {"pre_shift_hit_rate": 0.8, "lowest_hit_rate": 0.3,
                                             "recovery_tokens": 320 - 128}  # 0.75 is within 10% of 0.8
    assert shift_summary(intervals[:4], 128)["recovery_tokens"] is None


@pytest.mark.skipif(not RESULTS.exists(), reason="no result recorded")
def test_recorded_table_is_what_the_recorded_runs_give():
    assert to_markdown(json.loads(RESULTS.read_text())) == RESULTS.with_suffix(".md").read_text()
