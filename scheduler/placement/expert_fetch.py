"""Which of a forward's missed experts to fetch over the link rather than compute on the CPU
(ScheInfer's token assignment with whole experts as the unit; FreeToken's fetch of the experts a
big batch routes to). Only routed experts are candidates, and only while fetching shortens the
layer: a decode's expert has a row or two, which the CPU computes in less time than copying its
weights takes; a prefill's has hundreds, which the GPU computes far faster once copied.

The layer's time is the later of two sides (ScheInfer's layer model, per expert):
- the GPU: its resident experts' GEMMs, while the fetch copies land one after another; then the
  fetched experts' GEMMs;
- the CPU: its experts' GEMMs and the hand-over, plus the copies where they are the host's own
  memcpy (the testbed: `SlicingCosts.copies_on_cpu`).
Experts are moved greedily, most rows first, while the maximum falls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.placement.slicing_cost import GemmCost, SlicingCosts


@dataclass(frozen=True)
class ExpertShape:
    """One expert's two GEMMs, as stored."""

    hidden_size: int
    intermediate_size: int
    gate_up_bytes: int
    down_bytes: int
    image_bytes: int  # what a fetch copies

    def gemm_s(self, cost: GemmCost, num_rows: int) -> float:
        hidden, inter = self.hidden_size, self.intermediate_size
        return (cost.time_s(num_rows * 2 * inter * hidden, self.gate_up_bytes)
                + cost.time_s(num_rows * hidden * inter, self.down_bytes))


class FetchModel:
    """Chooses the experts a forward fetches from the slicing models' measured costs."""

    def __init__(self, costs: SlicingCosts, expert: ExpertShape) -> None:
        self.costs = costs
        self.expert = expert
        self.copy_s = costs.link.time_s(expert.image_bytes)
        self._cpu_s: dict[int, float] = {}
        self._gpu_s: dict[int, float] = {}

    def _cpu(self, num_rows: int) -> float:
        if num_rows not in self._cpu_s:
            self._cpu_s[num_rows] = self.expert.gemm_s(self.costs.cpu_gemm, num_rows)
        return self._cpu_s[num_rows]

    def _gpu(self, num_rows: int) -> float:
        if num_rows not in self._gpu_s:
            self._gpu_s[num_rows] = self.expert.gemm_s(self.costs.gpu_gemm, num_rows)
        return self._gpu_s[num_rows]

    def layer_s(self, hit_rows: Sequence[int], cpu_rows: Sequence[int], fetched_rows: Sequence[int]) -> float:
        """The layer's experts' time with these experts resident, on the CPU and fetched."""
        costs = self.costs
        copies = self.copy_s * len(fetched_rows)
        gpu = max(sum(self._gpu(rows) for rows in hit_rows), copies) + sum(self._gpu(rows) for rows in fetched_rows)
        cpu = sum(self._cpu(rows) for rows in cpu_rows) + (costs.handoff_s if cpu_rows else 0.0)
        if costs.copies_on_cpu:  # the copies are the CPU side's threads' memcpy
            cpu += copies
        if gpu and cpu:
            gpu, cpu = gpu * costs.gpu_gemm_slowdown, cpu * costs.cpu_gemm_slowdown
        return max(gpu, cpu)

    def choose(self, hit_rows: Sequence[int], miss_rows: Sequence[int], max_fetches: int) -> list[int]:
        """Indices into `miss_rows` of the experts to fetch (at most `max_fetches`), most rows first."""
        order = sorted(range(len(miss_rows)), key=lambda i: -miss_rows[i])
        if not order or max_fetches <= 0 or self._cpu(miss_rows[order[0]]) <= self.copy_s:
            return []  # the biggest miss computes on the CPU faster than its copy alone: nothing pays
        chosen: list[int] = []
        best = self.layer_s(hit_rows, miss_rows, [])
        for count in range(1, min(max_fetches, len(order)) + 1):
            fetched = order[:count]
            rest = [miss_rows[i] for i in order[count:]]
            time_s = self.layer_s(hit_rows, rest, [miss_rows[i] for i in fetched])
            if time_s >= best:
                break
            best, chosen = time_s, fetched
        return chosen
