"""ScheInfer's performance models (sec. IV-A1): each kind of work takes `t = a + b * volume`, a
startup time plus a time per unit, and a kernel launch takes a constant time. The paper's Table
lists a, b and the fit's R^2 for GPU GEMM, CPU GEMM (FP16 and INT4) and PCIe; we fit the same
models from points profiled on this machine (engine/profiling/slicing_probe.py) by least squares.

Units: a copy's volume is its bytes. A GEMM's is its multiply-adds (tokens x out_features x
in_features; the paper's "workload of GEMM (dimensions of the input matrices)", read as their
product), plus, as a second volume, the bytes of its weight: a decode's GEMMs are few rows against
a whole weight, so their time follows the bytes read more than the multiply-adds (on this
machine a 1-token GEMM of a 16 MiB bf16 slice took about 1 ms, which the multiply-adds alone could
only fit with a 1 ms startup charged to every GEMM). With b_s_per_weight_byte = 0 it is the paper's
model. Both volumes grow linearly with a slice's rate and the first with its tokens, which is all
the solvers need. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

UNIT_BYTES = "bytes"


@dataclass(frozen=True)
class LinearCost:
    """t = a_s + b_s_per_unit * volume, fitted with `r_squared` (None when not fitted)."""

    a_s: float
    b_s_per_unit: float
    unit: str
    r_squared: float | None = None

    def __post_init__(self) -> None:
        if self.a_s < 0 or self.b_s_per_unit < 0:
            raise ValueError(f"a_s={self.a_s} and b_s_per_unit={self.b_s_per_unit} must be >= 0")

    def time_s(self, volume: float) -> float:
        return self.a_s + self.b_s_per_unit * volume

    def to_dict(self) -> dict[str, Any]:
        return {"a_s": self.a_s, "b_s_per_unit": self.b_s_per_unit, "unit": self.unit, "r_squared": self.r_squared}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinearCost":
        return cls(float(data["a_s"]), float(data["b_s_per_unit"]), str(data["unit"]),
                   None if data.get("r_squared") is None else float(data["r_squared"]))


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is singular."""
    size = len(vector)
    rows = [row[:] + [value] for row, value in zip(matrix, vector)]
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        scale = max(abs(value) for row in rows for value in row[:size]) or 1.0
        if abs(rows[pivot][column]) <= 1e-12 * scale:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(column + 1, size):
            factor = rows[r][column] / rows[column][column]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[column])]
    solution = [0.0] * size
    for r in range(size - 1, -1, -1):
        solution[r] = (rows[r][size] - sum(rows[r][c] * solution[c] for c in range(r + 1, size))) / rows[r][r]
    return solution


def fit_nonnegative(volumes: Sequence[Sequence[float]], times: Sequence[float]) -> tuple[list[float], float]:
    """Coefficients [a, b_1, ..., b_k] >= 0 of t = a + sum b_i * volume_i by least squares, each
    error taken relative to its point's time (weights 1/t^2 on squared errors): a decode's slices
    are small GEMMs and copies, and a plain fit, ruled by the largest points, missed this
    machine's 1-token GEMMs by 113-143% (median) where the relative one missed them by 20-23%
    (SmolLM2's MLP slices at 1-64 tokens on the testbed). Negative coefficients (noise on a flat
    or tiny profile) would let the solver find free work, so the fit is the best with every
    coefficient >= 0: the least squares on each subset of the coefficients, the best of those
    that come out non-negative. -> (coefficients, R^2 of the times, as the paper's Table gives)"""
    num_points = len(times)
    if num_points < 2 or any(len(row) != len(volumes[0]) for row in volumes) or len(volumes) != num_points:
        raise ValueError(f"points: a linear cost needs two or more of one width, got {num_points}")
    if any(v < 0 for row in volumes for v in row) or any(t <= 0 for t in times):
        raise ValueError("points: volumes must be >= 0 and times > 0")
    columns = [[1.0] * num_points] + [[float(row[i]) for row in volumes] for i in range(len(volumes[0]))]
    if all(max(column) == min(column) for column in columns[1:]):
        raise ValueError("points: a linear cost needs two or more distinct volumes")
    # each column and the weights scaled to at most 1, so the normal equations stay well conditioned
    scales = [max(column) or 1.0 for column in columns]
    columns = [[value / scale for value in column] for column, scale in zip(columns, scales)]
    weights = [min(times) ** 2 / (t * t) for t in times]

    def relative_error(coefficients: list[float]) -> float:
        return sum(w * (sum(c * col[p] for c, col in zip(coefficients, columns)) - t) ** 2
                   for p, (w, t) in enumerate(zip(weights, times)))
    best: list[float] | None = None
    for mask in range(1, 2 ** len(columns)):
        chosen = [i for i in range(len(columns)) if mask >> i & 1]
        normal = [[sum(w * columns[i][p] * columns[j][p] for p, w in enumerate(weights)) for j in chosen]
                  for i in chosen]
        right = [sum(w * columns[i][p] * t for p, (w, t) in enumerate(zip(weights, times))) for i in chosen]
        solution = _solve(normal, right)
        if solution is None or min(solution) < 0:
            continue
        coefficients = [0.0] * len(columns)
        for i, value in zip(chosen, solution):
            coefficients[i] = value
        if best is None or relative_error(coefficients) < relative_error(best):
            best = coefficients
    mean_t = sum(times) / num_points
    residual = sum((sum(c * col[p] for c, col in zip(best, columns)) - t) ** 2 for p, t in enumerate(times))
    total = sum((t - mean_t) ** 2 for t in times)
    return [c / scale for c, scale in zip(best, scales)], 1.0 - residual / total if total > 0 else 1.0


def fit_linear_cost(points: Sequence[tuple[float, float]], unit: str) -> LinearCost:
    """t = a + b * volume fitted to (volume, seconds) points (`fit_nonnegative`)."""
    (a_s, b_s), r_squared = fit_nonnegative([(v,) for v, _ in points], [t for _, t in points])
    return LinearCost(a_s, b_s, unit, r_squared)


@dataclass(frozen=True)
class GemmCost:
    """t = a_s + b_s_per_multiply_add * multiply_adds + b_s_per_weight_byte * weight_bytes."""

    a_s: float
    b_s_per_multiply_add: float
    b_s_per_weight_byte: float = 0.0
    r_squared: float | None = None

    def __post_init__(self) -> None:
        if min(self.a_s, self.b_s_per_multiply_add, self.b_s_per_weight_byte) < 0:
            raise ValueError(f"a_s={self.a_s}, b_s_per_multiply_add={self.b_s_per_multiply_add} and "
                             f"b_s_per_weight_byte={self.b_s_per_weight_byte} must be >= 0")

    def time_s(self, multiply_adds: float, weight_bytes: float) -> float:
        return self.a_s + self.b_s_per_multiply_add * multiply_adds + self.b_s_per_weight_byte * weight_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"a_s": self.a_s, "b_s_per_multiply_add": self.b_s_per_multiply_add,
                "b_s_per_weight_byte": self.b_s_per_weight_byte, "r_squared": self.r_squared}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GemmCost":
        return cls(float(data["a_s"]), float(data["b_s_per_multiply_add"]), float(data["b_s_per_weight_byte"]),
                   None if data.get("r_squared") is None else float(data["r_squared"]))


def fit_gemm_cost(points: Sequence[tuple[float, float, float]]) -> GemmCost:
    """GemmCost fitted to (multiply-adds, weight bytes, seconds) points (`fit_nonnegative`)."""
    (a_s, per_multiply_add, per_byte), r_squared = fit_nonnegative([(m, b) for m, b, _ in points],
                                                                   [t for _, _, t in points])
    return GemmCost(a_s, per_multiply_add, per_byte, r_squared)


@dataclass(frozen=True)
class SlicingCosts:
    """The models for one weight format (dense in the compute dtype, or INT4): GEMMs on the
    GPU and on the CPU, host -> GPU copies by bytes (the same model for the
    activations' hops), and one kernel launch."""

    gpu_gemm: GemmCost
    cpu_gemm: GemmCost
    link: LinearCost
    launch_s: float
    # How many times longer each side's GEMMs take while the other side computes too (measured:
    # where CPU and GPU share cores or a memory bus, as on the host-only testbed, > 1).
    cpu_gemm_slowdown: float = 1.0
    gpu_gemm_slowdown: float = 1.0
    link_slowdown: float = 1.0  # copies while GEMMs run (the planner's link_bytes_per_s_under_compute)
    # The copy engine is a thread on the CPU side's cores (the host-only testbed), not a DMA
    # engine: copies take the CPU's time (slicing_model._copies_on_cpu).
    copies_on_cpu: bool = False
    # A CPU part's fixed cost beyond its GEMMs: the GPU's side handing it to the CPU side
    # and taking its result back (on the testbed two thread wake-ups), once per layer with CC.
    handoff_s: float = 0.0

    def __post_init__(self) -> None:
        if self.launch_s < 0 or self.handoff_s < 0:
            raise ValueError(f"launch_s={self.launch_s} and handoff_s={self.handoff_s} must be >= 0")
        for name in ("cpu_gemm_slowdown", "gpu_gemm_slowdown", "link_slowdown"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.link.unit != UNIT_BYTES:
            raise ValueError(f"link must be a model in {UNIT_BYTES}, got {self.link.unit}")

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_gemm": self.gpu_gemm.to_dict(), "cpu_gemm": self.cpu_gemm.to_dict(),
                "link": self.link.to_dict(), "launch_s": self.launch_s, "cpu_gemm_slowdown": self.cpu_gemm_slowdown,
                "gpu_gemm_slowdown": self.gpu_gemm_slowdown, "link_slowdown": self.link_slowdown,
                "copies_on_cpu": self.copies_on_cpu, "handoff_s": self.handoff_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SlicingCosts":
        return cls(GemmCost.from_dict(data["gpu_gemm"]), GemmCost.from_dict(data["cpu_gemm"]),
                   LinearCost.from_dict(data["link"]), float(data["launch_s"]),
                   float(data["cpu_gemm_slowdown"]), float(data["gpu_gemm_slowdown"]),
                   float(data["link_slowdown"]), bool(data["copies_on_cpu"]), float(data["handoff_s"]))
