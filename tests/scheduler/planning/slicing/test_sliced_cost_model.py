"""The scheduler's view of sliced MLPs: the CPU's busy time per layer from the slicing model
(followed by hand on round numbers), charged beside the profiled tables as `cpu_linear`. No torch."""
import pytest

from scheduler.planning.offload_cost import SlicedMlpCostModel
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import UNIT_BYTES, GemmCost, LinearCost, SlicingCosts
from scheduler.planning.slicing.model import GemmWork, MlpWork, cpu_time_s
from test_neo_scheduler import make_cost_model

HAND_COSTS = SlicingCosts(GemmCost(1.0, 0.1), GemmCost(2.0, 1.0), LinearCost(3.0, 0.01, UNIT_BYTES), 0.5)


def hand_work(num_tokens: int) -> MlpWork:
    return MlpWork((GemmWork(100.0 * num_tokens, 1000), GemmWork(50.0 * num_tokens, 500)), num_tokens=num_tokens,
                   hop_bytes=200 * num_tokens)


@pytest.mark.parametrize("rates, expected_s", [
    (SliceRates(1.0, 0.0, 0.0), 3 + 2 + (2 + 100) + (2 + 50)),  # x's hop, both GEMMs whole on the CPU
    (SliceRates(0.5, 0.0, 0.5), 3 + 2 + (2 + 50) + (2 + 25)),  # half of each GEMM
    (SliceRates(0.0, 0.5, 0.5), 0.0),  # nothing on the CPU: not even the hop
])
def test_cpu_time_is_the_hop_and_the_cc_gemms(rates, expected_s):
    assert cpu_time_s(hand_work(1), HAND_COSTS, rates) == pytest.approx(expected_s)


def test_sliced_cost_model_charges_the_mean_cc_time_and_keeps_the_tables():
    base = make_cost_model()
    rates = [SliceRates(1.0, 0.0, 0.0), SliceRates(0.5, 0.0, 0.5), SliceRates.resident(), SliceRates(0.0, 1.0, 0.0)]
    model = SlicedMlpCostModel(base, lambda num_tokens: [hand_work(num_tokens)] * len(rates), HAND_COSTS, rates)
    assert model.cpu_linear(0) == 0.0
    assert model.cpu_linear(1) == pytest.approx((159.0 + 84.0) / 4)
    assert model.cpu_linear(4) > model.cpu_linear(1)  # more tokens, longer CC GEMMs
    for num_tokens in (1, 7, 300):
        assert model.linear(num_tokens) == base.linear(num_tokens)
        assert model.linear_again(num_tokens) == base.linear_again(num_tokens)
    assert model.cpu_decode_attention(3, 90) == base.cpu_decode_attention(3, 90)
    with pytest.raises(ValueError, match="SliceRates"):
        SlicedMlpCostModel(base, hand_work, HAND_COSTS, [])
