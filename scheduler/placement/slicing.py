"""ScheInfer's slicing of a layer's MLP (sec. III-B): its intermediate units (gate/up rows and the
matching down columns), or a MoE layer's experts, divide into a part the CPU computes where it is
stored (CC), a part stored in host memory and shipped to the accelerator to be computed there
(CG), and a part resident on the accelerator (GG). The parts' outputs sum to the MLP's, as under
tensor parallelism. Plain Python, no torch: the planner chooses rates, the engine executes them."""
from __future__ import annotations

from dataclasses import dataclass

# Accelerator buffers the CG parts stream through (each of the largest CG part's bytes): two
# layers held at once (Neo's two-batch forward holds layer i+1 before it releases layer i) and one
# preloading. The engine's ring (engine/execution/sliced_mlp.py) and the planner's budget share it.
NUM_CG_BUFFERS = 3
# How far the three fractions may miss summing to one (they come from floating-point solvers).
RATE_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SliceRates:
    """Fractions of one layer's MLP units (or experts): CPU-computed, streamed and accelerator-computed,
    resident. Each in [0, 1], summing to 1."""

    cc: float
    cg: float
    gg: float

    def __post_init__(self) -> None:
        for name in ("cc", "cg", "gg"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"slice rate {name}={value} must lie in [0, 1]")
        if abs(self.cc + self.cg + self.gg - 1.0) > RATE_SUM_TOLERANCE:
            raise ValueError(f"slice rates cc={self.cc}, cg={self.cg}, gg={self.gg} must sum to 1")

    @classmethod
    def resident(cls) -> "SliceRates":
        return cls(0.0, 0.0, 1.0)

    def counts(self, num_units: int, align: int = 1) -> tuple[int, int, int]:
        """Units for (CC, CG, GG) out of `num_units`: CC and CG rounded to the nearest multiple of
        `align` (a quantization block's width), GG the rest, unless its rate is 0: then the last
        part with a rate takes the rest, so nothing lands where no memory was planned for it."""
        if num_units < 0 or align < 1:
            raise ValueError(f"num_units={num_units} and align={align} must be >= 0 and >= 1")
        cc = min(num_units, round(self.cc * num_units / align) * align)
        cg = min(num_units - cc, round(self.cg * num_units / align) * align)
        if self.gg == 0.0:
            if self.cg > 0.0:
                return cc, num_units - cc, 0
            return num_units, 0, 0
        return cc, cg, num_units - cc - cg
