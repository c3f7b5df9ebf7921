"""ScheInfer's solvers (sec. IV-A3 to IV-B) over the layer-time model of slicing_model.py. Plain
Python, no torch.

- `solve_cc`: at a fixed GG rate, the CC rate (CG the rest) with the least layer time. With the
  slice pattern fixed the time is a maximum of lines in the CC rate (convex, piecewise linear), so
  its minimum over the open interval (0, 1 - GG) lies where two lines cross; the ends, where a part
  empties and its startup costs vanish, are evaluated on their own. That is the paper's "edge
  points" rule, with the crossings taken from the model instead of its three hand-derived cases.
- `assign_gg`: the greedy per-layer assignment of GPU memory (eq. 14).
- `solve_moved_tokens`: in a prefill, how many tokens CG' computes on the GPU with CC's
  weights shipped over; the same edge points over an integer count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.slicing.model import EMPTY_SHARE, Affine, MlpWork, SliceTerms, layer_pieces, layer_time_s


@dataclass(frozen=True)
class SolvedRates:
    rates: SliceRates
    time_s: float


def _rates(cc: float, gg: float) -> SliceRates:
    """Rates from CC and GG, CG the rest, clamped against floating-point leftovers."""
    cc = min(max(cc, 0.0), 1.0 - gg)
    return SliceRates(cc, max(0.0, 1.0 - gg - cc), gg)


def solve_cc(work: MlpWork, costs: SlicingCosts, gg: float, moved_share: float = 0.0,
             max_cg: float = 1.0) -> SolvedRates:
    """The best CC rate at this GG rate (with `moved_share` of the tokens on CG', 0 in a decode),
    CG the rest but at most `max_cg` (what the stream buffers hold). A MoE layer's rates are
    whole experts: each crossing's experts either side are evaluated instead of the crossing
    (exact too: between two crossings the time is linear), and GG and `max_cg` should then be
    multiples of 1 / num_experts."""
    if not 0.0 <= gg <= 1.0 or max_cg < 0.0:
        raise ValueError(f"gg={gg} must lie in [0, 1] and max_cg={max_cg} be >= 0")
    free = 1.0 - gg  # what CC and CG share
    if work.num_experts:
        max_cg = math.floor(max_cg * work.num_experts + EMPTY_SHARE) / work.num_experts
    low = max(0.0, free - max_cg)  # the least CC that leaves CG within max_cg
    candidates = {low, free}  # at the ends a part may empty and its fixed costs go: their own pattern
    if free - low > EMPTY_SHARE:
        interior = layer_pieces(work, costs, SliceTerms(
            cc=Affine(0.0, 1.0), cg=Affine(free, -1.0), gg=Affine(gg), moved_share=Affine(moved_share),
            has_cc=moved_share < 1.0 - EMPTY_SHARE, has_cg=True, has_gg=gg > EMPTY_SHARE,
            has_moved=moved_share > EMPTY_SHARE))
        candidates.update(_on_unit_grid(interior.crossings(low, free), work.num_experts, low, free))
    times = {cc: layer_pieces(work, costs, SliceTerms.at(_rates(cc, gg), moved_share)).at(0.0) for cc in candidates}
    best = min(times, key=lambda cc: (times[cc], cc))
    return SolvedRates(_rates(best, gg), times[best])


def _on_unit_grid(points: list[float], num_units: int, low: float, high: float) -> set[float]:
    """The points themselves for rates cut by rows (num_units 0); else the multiples of
    1 / num_units either side of each, within [low, high]."""
    if not num_units:
        return set(points)
    snapped = {side(x * num_units) / num_units for x in points for side in (math.floor, math.ceil)}
    return {x for x in snapped if low - EMPTY_SHARE <= x <= high + EMPTY_SHARE}


def solve_moved_tokens(work: MlpWork, costs: SlicingCosts, rates: SliceRates) -> tuple[int, float]:
    """The number of a prefill's tokens to compute with CG' instead of on the CPU, and the layer's
    time then (sec. IV-B). The rates stay those solved for decode; the unknown is the count, so
    shares are linear in it and the edge points are 0, all tokens, and the integers either side of
    each crossing."""
    num_tokens = work.num_tokens
    times = {count: layer_time_s(work, costs, rates, count) for count in (0, num_tokens)}
    if rates.cc > EMPTY_SHARE and num_tokens > 1:
        interior = layer_pieces(work, costs, SliceTerms(
            cc=Affine(rates.cc), cg=Affine(rates.cg), gg=Affine(rates.gg), moved_share=Affine(0.0, 1.0 / num_tokens),
            has_cc=True, has_cg=rates.cg > EMPTY_SHARE, has_gg=rates.gg > EMPTY_SHARE, has_moved=True))
        for x in interior.crossings(0.0, float(num_tokens)):
            times.update((count, interior.at(count)) for count in (math.floor(x), math.ceil(x))
                         if 0 < count < num_tokens)
    best = min(times, key=lambda count: (times[count], count))
    return best, times[best]


@dataclass(frozen=True)
class LayerChoices:
    """One layer's candidate GG rates (ascending, the first the starting point), the best time at
    each, and the GPU bytes each keeps resident."""

    solved: tuple[SolvedRates, ...]
    resident_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.solved or len(self.solved) != len(self.resident_bytes):
            raise ValueError("solved and resident_bytes must be non-empty and of one length")
        if any(b <= a for a, b in zip(self.resident_bytes, self.resident_bytes[1:])):
            raise ValueError(f"resident_bytes must increase with the GG rate, got {self.resident_bytes}")


def rate_steps(work: MlpWork, num_steps: int = 8) -> tuple[float, ...]:
    """The GG rates the greedy chooses among (and the caps on CG the planner tries): `num_steps`
    equal steps from 0 to 1; for a MoE layer, whole experts in steps of ceil(num_experts / num_steps)."""
    if not work.num_experts:
        return tuple(i / num_steps for i in range(num_steps + 1))
    step = math.ceil(work.num_experts / num_steps)
    counts = sorted({*range(0, work.num_experts, step), work.num_experts})
    return tuple(count / work.num_experts for count in counts)


def layer_choices(work: MlpWork, costs: SlicingCosts, gg_rates: Sequence[float], max_cg: float = 1.0) -> LayerChoices:
    """Each candidate GG rate solved for its best CC rate (CG at most `max_cg`); its resident bytes
    are gg x the layer's."""
    gg_rates = sorted(gg_rates)
    return LayerChoices(tuple(solve_cc(work, costs, gg, max_cg=max_cg) for gg in gg_rates),
                        tuple(round(gg * work.weight_bytes) for gg in gg_rates))


def assign_gg(layers: Sequence[LayerChoices], budget_bytes: int) -> list[int]:
    """Which candidate each layer takes (indices into its choices), by eq. 14's greedy: every
    layer starts at its first candidate; each round, over every layer and every larger candidate
    that still fits the budget, the importance is the time it saves over the layer's current
    choice divided by the bytes it adds, and the most important is taken; until nothing fitting
    saves time. Taking any larger candidate, not only the next one, lets a layer step over a
    candidate whose own gain is small (a GG part's first launch and startup cost more than a
    small slice saves).

    The greedy is the optimum when each layer's time falls convexly in its resident bytes and the
    candidates are equal steps of equal size across layers (the knapsack then has a greedy
    solution). The model's curves are convex without fixed costs (tests/scheduler/
    test_slicing_solver.py checks it), but startups, launches and the activations' hops appear and
    vanish with a part (and so does a side's slowdown beside the other), which can bend them: on
    small random cases with such costs the greedy missed the exhaustive optimum at 10 of 520
    budgets (layers with their own costs) and 9 of 680 (identical layers), by at most 6.9%."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
    chosen = [0] * len(layers)
    spent = sum(layer.resident_bytes[0] for layer in layers)
    if spent > budget_bytes:
        raise ValueError(f"budget_bytes={budget_bytes} is below the first candidates' {spent} bytes")
    while True:
        best: tuple[float, int, int] | None = None  # (importance, layer, candidate)
        for index, layer in enumerate(layers):
            now = chosen[index]
            for candidate in range(now + 1, len(layer.solved)):
                extra = layer.resident_bytes[candidate] - layer.resident_bytes[now]
                saved = layer.solved[now].time_s - layer.solved[candidate].time_s
                if spent + extra <= budget_bytes and saved > 0 and (best is None or saved / extra > best[0]):
                    best = (saved / extra, index, candidate)
        if best is None:
            return chosen
        _, index, candidate = best
        spent += layers[index].resident_bytes[candidate] - layers[index].resident_bytes[chosen[index]]
        chosen[index] = candidate
