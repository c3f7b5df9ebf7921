"""The engine's prefill token assignment policy (scheduler/planning/slicing/moved_tokens.py): each layer's
count is the solver's for that layer's work at its rates, solved once per (work, rates)."""
import random

from test_slicing_model import random_costs

import scheduler.planning.slicing.moved_tokens as moved_tokens
from scheduler.planning.memory import WeightFormat
from scheduler.planning.slicing.moved_tokens import SolvedMovedTokens
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import UNIT_BYTES, GemmCost, LinearCost, SlicingCosts
from scheduler.planning.slicing.model import dense_mlp_work, moe_mlp_work
from scheduler.planning.slicing.solver import solve_moved_tokens

FMT = WeightFormat("none", 2)
# the paper's testbed A (FP16 models of its Table): a prefill's CPU share dwarfs the rest
TESTBED_A = SlicingCosts(GemmCost(1.0e-7, 3.2e-12), GemmCost(7.4e-7, 1.6e-11), LinearCost(3.0e-6, 2.6e-11, UNIT_BYTES),
                         4.4e-5)
RATES = (SliceRates(0.6, 0.2, 0.2), SliceRates(0.0, 0.5, 0.5), SliceRates(0.6, 0.2, 0.2))


class CountingWorks:
    """The layers' work, a 4096/11008 MLP each, counting how often the policy asks for it."""

    def __init__(self) -> None:
        self.num_calls = 0

    def __call__(self, num_tokens: int):
        self.num_calls += 1
        return [dense_mlp_work(4096, 11008, num_tokens, FMT)] * len(RATES)


def test_each_layer_gets_the_solvers_count_at_its_rates():
    rng = random.Random(0)
    for costs in [TESTBED_A, *(random_costs(rng) for _ in range(20))]:
        policy = SolvedMovedTokens(RATES, costs, CountingWorks())
        for layer, rates in enumerate(RATES):
            for num_tokens in (1, 7, 512):
                expected, _ = solve_moved_tokens(dense_mlp_work(4096, 11008, num_tokens, FMT), costs, rates)
                assert policy.count(layer, num_tokens) == expected


def test_a_prefill_moves_some_tokens_and_a_decode_none():
    policy = SolvedMovedTokens(RATES, TESTBED_A, CountingWorks())
    assert 0 < policy.count(0, 512) < 512
    assert policy.count(0, 1) == 0
    assert policy.count(1, 512) == 0  # no CC part: nothing to move


def test_counts_are_solved_once_per_work_and_rates(monkeypatch):
    solved = []

    def counting_solver(work, costs, rates):
        solved.append((work.num_tokens, rates))
        return solve_moved_tokens(work, costs, rates)

    monkeypatch.setattr(moved_tokens, "solve_moved_tokens", counting_solver)
    works = CountingWorks()
    policy = SolvedMovedTokens(RATES, TESTBED_A, works)
    first = [policy.count(layer, 512) for layer in range(len(RATES))]
    assert len(solved) == 2 and works.num_calls == 1  # layers 0 and 2 share their work and rates
    assert [policy.count(layer, 512) for layer in range(len(RATES))] == first
    assert len(solved) == 2 and works.num_calls == 1
    policy.count(0, 64)
    assert len(solved) == 3 and works.num_calls == 2


def test_a_moe_layer_is_solved_with_its_own_work():
    """Layers of equal rates but different work (a MoE model's dense and expert layers) apart."""
    rates = (SliceRates(0.6, 0.2, 0.2),) * 2

    def works(num_tokens):
        return [dense_mlp_work(4096, 11008, num_tokens, FMT), moe_mlp_work(4096, 1408, 64, 6, num_tokens, FMT)]

    policy = SolvedMovedTokens(rates, TESTBED_A, works)
    for layer in range(2):
        assert policy.count(layer, 512) == solve_moved_tokens(works(512)[layer], TESTBED_A, rates[0])[0]
