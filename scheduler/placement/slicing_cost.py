"""ScheInfer's performance models (sec. IV-A1): each kind of work takes `t = a + b * volume`, a
startup time plus a time per unit, and a kernel launch takes a constant time. The paper's Table
lists a, b and the fit's R^2 for GPU GEMM, CPU GEMM (FP16 and INT4) and PCIe; we fit the same
models from points profiled on this machine (engine/profiling/slicing_probe.py) by least squares.

Units: a GEMM's volume is its multiply-adds (tokens x out_features x in_features; the paper's
"workload of GEMM (dimensions of the input matrices)", read as their product, since that is what
a GEMM's time grows with); a transfer's volume is its bytes. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

UNIT_MULTIPLY_ADDS = "multiply-adds"
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


def fit_linear_cost(points: Sequence[tuple[float, float]], unit: str) -> LinearCost:
    """Least squares of (volume, seconds) points, each error taken relative to its point's time
    (weights 1/t): a decode's slices are small GEMMs and copies, and a plain fit, ruled by the
    largest points, missed this machine's 1-token GEMMs by 113-143% (median) where the relative one
    missed them by 20-23% (SmolLM2's MLP slices at 1-64 tokens on the testbed). A negative fitted startup or slope (noise on a
    flat or tiny profile) is clamped to zero and the other refitted, since a model that predicts
    negative times would let the solver find free work. R^2 is the usual one, of the times, as
    the paper's Table reports it."""
    if len(points) < 2:
        raise ValueError(f"points: a linear cost needs two or more, got {len(points)}")
    volumes = [float(v) for v, _ in points]
    times = [float(t) for _, t in points]
    if any(v < 0 for v in volumes) or any(t <= 0 for t in times):
        raise ValueError("points: volumes must be >= 0 and times > 0")
    if max(volumes) == min(volumes):
        raise ValueError("points: a linear cost needs two or more distinct volumes")
    weights = [1.0 / (t * t) for t in times]  # squared relative errors: ((fit - t) / t)^2
    rows = list(zip(weights, volumes, times))
    s0, s1, s2 = sum(weights), sum(w * v for w, v, _ in rows), sum(w * v * v for w, v, _ in rows)
    t0, t1 = sum(w * t for w, _, t in rows), sum(w * v * t for w, v, t in rows)
    slope = (s0 * t1 - s1 * t0) / (s0 * s2 - s1 * s1)
    intercept = (t0 - slope * s1) / s0
    if slope < 0:
        slope, intercept = 0.0, t0 / s0
    elif intercept < 0:
        slope, intercept = t1 / s2, 0.0
    mean_t = sum(times) / len(times)
    residual = sum((t - intercept - slope * v) ** 2 for v, t in zip(volumes, times))
    total = sum((t - mean_t) ** 2 for t in times)
    r_squared = 1.0 - residual / total if total > 0 else 1.0
    return LinearCost(intercept, slope, unit, r_squared)


@dataclass(frozen=True)
class SlicingCosts:
    """The models for one weight format (dense in the compute dtype, or INT4): GEMMs on the
    accelerator and on the CPU by multiply-adds, host -> accelerator copies by bytes (the same
    model for the activations' hops), and one kernel launch."""

    accelerator_gemm: LinearCost
    cpu_gemm: LinearCost
    link: LinearCost
    launch_s: float

    def __post_init__(self) -> None:
        if self.launch_s < 0:
            raise ValueError(f"launch_s={self.launch_s} must be >= 0")
        for name, unit in (("accelerator_gemm", UNIT_MULTIPLY_ADDS), ("cpu_gemm", UNIT_MULTIPLY_ADDS),
                           ("link", UNIT_BYTES)):
            if getattr(self, name).unit != unit:
                raise ValueError(f"{name} must be a model in {unit}, got {getattr(self, name).unit}")

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator_gemm": self.accelerator_gemm.to_dict(), "cpu_gemm": self.cpu_gemm.to_dict(),
                "link": self.link.to_dict(), "launch_s": self.launch_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SlicingCosts":
        return cls(LinearCost.from_dict(data["accelerator_gemm"]), LinearCost.from_dict(data["cpu_gemm"]),
                   LinearCost.from_dict(data["link"]), float(data["launch_s"]))
