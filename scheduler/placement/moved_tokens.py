"""ScheInfer's prefill token assignment (sec. IV-B) as the engine asks for it: of a forward's
tokens reaching a sliced layer's MLP, how many CG' computes on the accelerator, CC's weights
copied over, instead of the CPU. Plain Python, no torch: the engine's store
(engine/execution/mlp_slicing.py) asks per layer and forward; `SolvedMovedTokens` answers from
the slicing models, solved once per (rates, token count)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from scheduler.placement.slicing import SliceRates
from scheduler.placement.slicing_cost import SlicingCosts
from scheduler.placement.slicing_model import MlpWork
from scheduler.placement.slicing_solver import solve_moved_tokens


class MovedTokens(ABC):
    """How many of a forward's tokens each sliced layer moves from the CPU to CG'."""

    @abstractmethod
    def count(self, layer: int, num_tokens: int) -> int:
        """Of `num_tokens` (>= 1) rows reaching layer `layer`'s sliced MLP, how many CG' computes
        (0 to num_tokens); the CPU computes CC for the rest."""


class SolvedMovedTokens(MovedTokens):
    """The count with the least predicted layer time (`solve_moved_tokens`) at each layer's rates,
    from `work(num_tokens)` (the layer's MLP at a token count) and the measured `costs`. Solved
    once per (rates, token count) and kept: a serving iteration pays a dict lookup per layer
    after the first, and there are at most as many keys as distinct rates times token counts up
    to the batch's token bound."""

    def __init__(self, rates: Sequence[SliceRates], costs: SlicingCosts, work: Callable[[int], MlpWork]) -> None:
        self.rates = tuple(rates)
        self.costs = costs
        self.work = work
        self._counts: dict[tuple[SliceRates, int], int] = {}

    def count(self, layer: int, num_tokens: int) -> int:
        key = (self.rates[layer], num_tokens)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = solve_moved_tokens(self.work(num_tokens), self.costs, key[0])[0]
        return count
