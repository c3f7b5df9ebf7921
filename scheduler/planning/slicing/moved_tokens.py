"""ScheInfer's prefill token assignment (sec. IV-B) as the engine asks for it: of a forward's
tokens reaching a sliced layer's MLP, how many CG' computes on the GPU, CC's weights
copied over, instead of the CPU. Plain Python, no torch: the engine's store
(engine/offload/slicing/sliced_mlp.py) asks per layer and forward; `SolvedMovedTokens` answers from
the slicing models, solved once per layer work (its token count included) and rates."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.slicing.model import MlpWork
from scheduler.planning.slicing.solver import solve_moved_tokens


class MovedTokens(ABC):
    """How many of a forward's tokens each sliced layer moves from the CPU to CG'."""

    @abstractmethod
    def count(self, layer: int, num_tokens: int) -> int:
        """Of `num_tokens` (>= 1) rows reaching layer `layer`'s sliced MLP, how many CG' computes
        (0 to num_tokens); the CPU computes CC for the rest."""


class SolvedMovedTokens(MovedTokens):
    """The count with the least predicted layer time (`solve_moved_tokens`) at each layer's rates,
    from `works(num_tokens)` (every layer's sliced work at a token count, slicing_plan.layer_works)
    and the measured `costs`. Solved once per (work, rates) and kept: a serving iteration pays
    dict lookups after the first of its size, and there are at most as many keys as distinct
    (layer work, rates) pairs times token counts up to the batch's token bound."""

    def __init__(self, rates: Sequence[SliceRates], costs: SlicingCosts,
                 works: Callable[[int], Sequence[MlpWork]]) -> None:
        self.rates = tuple(rates)
        self.costs = costs
        self.works = works
        self._works: dict[int, Sequence[MlpWork]] = {}  # by token count
        self._counts: dict[tuple[MlpWork, SliceRates], int] = {}

    def count(self, layer: int, num_tokens: int) -> int:
        works = self._works.get(num_tokens)
        if works is None:
            works = self._works[num_tokens] = self.works(num_tokens)
        work, rates = works[layer], self.rates[layer]
        count = self._counts.get((work, rates))
        if count is None:
            count = self._counts[work, rates] = solve_moved_tokens(work, self.costs, rates)[0]
        return count
