"""Where a forward's routed experts compute (ScheInfer's token assignment with whole experts as the
unit; FreeToken's fetch of the experts a big batch routes to). The GPU holds its hot experts, the
host holds every expert, so three moves are open per forward:
- a hot expert computes on the GPU, or on the CPU where the GPU has more than its share (on the
  testbed, one core against one core, a high hit rate leaves the GPU the slower side);
- a missed expert computes on the CPU, or is fetched over the link into a buffer where its rows
  make the copy pay (a decode's expert has a row or two, which the CPU computes in less time than
  the copy takes; a prefill's has hundreds, which the GPU computes far faster once copied).

The layer's time is the later of two sides (ScheInfer's layer model, per expert):
- the GPU: its hot experts' GEMMs, while the fetch copies land one after another; then the
  fetched experts' GEMMs;
- the CPU: its experts' GEMMs and the hand-over, plus the copies where they are the host's own
  memcpy (the testbed: `SlicingCosts.copies_on_cpu`).
Experts move greedily, most rows first, while the maximum falls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from scheduler.planning.slicing.cost import GemmCost, SlicingCosts

FORGETTING = 0.02  # the weight one forward's measurement takes from the older ones in a side's fit
PRIOR_WEIGHT = 0.05  # how strongly a side's fit holds to the probe's model before measurements


@dataclass(frozen=True)
class ExpertShape:
    """One expert's two GEMMs, as stored."""

    hidden_size: int
    intermediate_size: int
    gate_up_bytes: int
    down_bytes: int
    image_bytes: int  # what a fetch copies

    def terms_s(self, cost: GemmCost, num_rows: int) -> tuple[float, float]:
        """(the fixed part: startups and reading the weights; the part growing with the rows)"""
        read_s = 2 * cost.a_s + cost.b_s_per_weight_byte * (self.gate_up_bytes + self.down_bytes)
        return read_s, cost.b_s_per_multiply_add * num_rows * 3 * self.intermediate_size * self.hidden_size


class SideFit:
    """measured = read * modelled fixed time + math * modelled row time, for one side's experts:
    least squares over the measurements so far, older ones fading (FORGETTING), starting at the
    probe's model (read = math = 1). The probe times slices with caches spilled once; a forward
    reads tens of experts from DRAM beside the other side's reads, and its two terms drift apart."""

    def __init__(self) -> None:
        # the normal equations' sums: x_read^2, x_read x_math, x_math^2, x_read y, x_math y
        self._sums = [PRIOR_WEIGHT, 0.0, PRIOR_WEIGHT, PRIOR_WEIGHT, PRIOR_WEIGHT]
        self.read, self.math = 1.0, 1.0

    def observe(self, read_s: float, math_s: float, measured_s: float) -> None:
        scale = max(read_s + math_s, 1e-12)  # relative errors: a decode's forward counts as a prefill's
        x1, x2, y = read_s / scale, math_s / scale, measured_s / scale
        self._sums = [(1 - FORGETTING) * total + FORGETTING * value
                      for total, value in zip(self._sums, (x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y))]
        s11, s12, s22, s1y, s2y = self._sums
        det = s11 * s22 - s12 * s12
        if det > 1e-12:
            self.read = max(0.0, (s1y * s22 - s2y * s12) / det)
            self.math = max(0.0, (s2y * s11 - s1y * s12) / det)

    def time_s(self, read_s: float, math_s: float) -> float:
        return self.read * read_s + self.math * math_s


@dataclass(frozen=True)
class ExpertSplit:
    """A forward's departures from "hot on the GPU, missed on the CPU" (indices into its lists)."""

    fetched: list[int]  # misses copied into fetch buffers and computed on the GPU
    hits_on_cpu: list[int]  # hot experts the CPU computes this time


class SplitModel:
    """Splits a forward's experts between the sides by the slicing models' measured costs, each
    side's refitted to its measured expert times (`observe`, `SideFit`)."""

    def __init__(self, costs: SlicingCosts, expert: ExpertShape) -> None:
        self.costs = costs
        self.expert = expert
        self.copy_s = costs.link.time_s(expert.image_bytes)
        self.fits = {"gpu": SideFit(), "cpu": SideFit()}
        self._terms_s: dict[tuple[str, int], tuple[float, float]] = {}

    def _terms(self, side: str, num_rows: int) -> tuple[float, float]:
        key = (side, num_rows)
        if key not in self._terms_s:
            self._terms_s[key] = self.expert.terms_s(self.costs.gpu_gemm if side == "gpu" else self.costs.cpu_gemm,
                                                     num_rows)
        return self._terms_s[key]

    def _cpu(self, num_rows: int) -> float:
        return self.fits["cpu"].time_s(*self._terms("cpu", num_rows))

    def _gpu(self, num_rows: int) -> float:
        return self.fits["gpu"].time_s(*self._terms("gpu", num_rows))

    def observe(self, side: str, rows: Sequence[int], measured_s: float) -> None:
        """`side` ("gpu" or "cpu") took `measured_s` for experts of these row counts."""
        terms = [self._terms(side, num_rows) for num_rows in rows]
        self.fits[side].observe(sum(t[0] for t in terms), sum(t[1] for t in terms), measured_s)

    def layer_s(self, gpu_rows: Sequence[int], cpu_rows: Sequence[int], fetched_rows: Sequence[int]) -> float:
        """The layer's experts' time with these experts computed on the GPU, on the CPU and fetched."""
        costs = self.costs
        copies = self.copy_s * len(fetched_rows)
        gpu = max(sum(self._gpu(rows) for rows in gpu_rows), copies) + sum(self._gpu(rows) for rows in fetched_rows)
        cpu = sum(self._cpu(rows) for rows in cpu_rows) + (costs.handoff_s if cpu_rows else 0.0)
        if costs.copies_on_cpu:  # the copies are the CPU side's threads' memcpy
            cpu += copies
        if gpu and cpu:
            gpu, cpu = gpu * costs.gpu_gemm_slowdown, cpu * costs.cpu_gemm_slowdown
        return max(gpu, cpu)

    def split(self, hit_rows: Sequence[int], miss_rows: Sequence[int], max_fetches: int) -> ExpertSplit:
        """Which misses to fetch (at most `max_fetches`) and which hits the CPU takes instead."""
        hits = list(range(len(hit_rows)))
        fetched = self._fetches(hit_rows, miss_rows, max_fetches)
        if fetched:
            return ExpertSplit(fetched, [])
        on_cpu: list[int] = []
        best = self.layer_s(hit_rows, miss_rows, [])
        for index in sorted(hits, key=lambda i: -hit_rows[i]):
            moved = on_cpu + [index]
            time_s = self.layer_s([hit_rows[i] for i in hits if i not in moved],
                                  [*miss_rows, *(hit_rows[i] for i in moved)], [])
            if time_s < best:
                best, on_cpu = time_s, moved
        return ExpertSplit([], on_cpu)

    def _fetches(self, hit_rows: Sequence[int], miss_rows: Sequence[int], max_fetches: int) -> list[int]:
        """Indices into `miss_rows` of the experts to fetch, most rows first, while the layer shortens."""
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
