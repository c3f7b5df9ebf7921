"""The engine's prefill token assignment policy (scheduler/placement/moved_tokens.py): each layer's
count is the solver's at that layer's rates, solved once per (rates, token count)."""
import random

from test_slicing_model import random_costs

from scheduler.placement.memory import WeightFormat
from scheduler.placement.moved_tokens import SolvedMovedTokens
from scheduler.placement.slicing import SliceRates
from scheduler.placement.slicing_cost import UNIT_BYTES, GemmCost, LinearCost, SlicingCosts
from scheduler.placement.slicing_model import dense_mlp_work
from scheduler.placement.slicing_solver import solve_moved_tokens

FMT = WeightFormat("none", 2)
# the paper's testbed A (FP16 models of its Table): a prefill's CPU share dwarfs the rest
TESTBED_A = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                         4.4e-5)
RATES = (SliceRates(0.6, 0.2, 0.2), SliceRates(0.0, 0.5, 0.5), SliceRates(0.6, 0.2, 0.2))


class CountingWork:
    """The layer work of a 4096/11008 MLP, counting how often the policy asks for it."""

    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self, num_tokens: int):
        self.num_calls += 1
        return dense_mlp_work(4096, 11008, num_tokens, FMT)


def test_each_layer_gets_the_solvers_count_at_its_rates():
    rng = random.Random(0)
    for costs in [TESTBED_A, *(random_costs(rng) for _ in range(20))]:
        policy = SolvedMovedTokens(RATES, costs, CountingWork())
        for layer, rates in enumerate(RATES):
            for num_tokens in (1, 7, 512):
                expected, _ = solve_moved_tokens(dense_mlp_work(4096, 11008, num_tokens, FMT), costs, rates)
                assert policy.count(layer, num_tokens) == expected


def test_a_prefill_moves_some_tokens_and_a_decode_none():
    policy = SolvedMovedTokens(RATES, TESTBED_A, CountingWork())
    assert 0 < policy.count(0, 512) < 512
    assert policy.count(0, 1) == 0
    assert policy.count(1, 512) == 0  # no CC part: nothing to move


def test_counts_are_solved_once_per_rates_and_token_count():
    work = CountingWork()
    policy = SolvedMovedTokens(RATES, TESTBED_A, work)
    first = [policy.count(layer, 512) for layer in range(len(RATES))]
    assert work.num_calls == 2  # layers 0 and 2 share their rates
    assert [policy.count(layer, 512) for layer in range(len(RATES))] == first
    assert work.num_calls == 2
    policy.count(0, 64)
    assert work.num_calls == 3
