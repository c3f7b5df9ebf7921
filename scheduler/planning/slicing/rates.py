"""ScheInfer's slicing of a layer's MLP (sec. III-B): its intermediate units (gate/up rows and the
matching down columns), or a MoE layer's experts, divide into a part the CPU computes where it is
stored (CC), a part stored in host memory and shipped to the GPU to be computed there
(CG), and a part resident on the GPU (GG). The parts' outputs sum to the MLP's, as under
tensor parallelism. Plain Python, no torch: the planner chooses rates, the engine executes them."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from scheduler.modes import Mode

# GPU buffers the CG parts stream through (each of the largest CG part's bytes): two
# layers held at once (Neo's two-batch forward holds layer i+1 before it releases layer i) and one
# preloading. The engine's ring (engine/offload/slicing/sliced_mlp.py) and the planner's budget share it.
NUM_CG_BUFFERS = 3
# How far the three fractions may miss summing to one (they come from floating-point solvers).
RATE_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SliceRates:
    """Fractions of one layer's MLP units (or experts): CPU-computed, streamed and GPU-computed,
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


class SliceKind(str, Enum):
    """ScheInfer's parts of a sliced MLP, in unit order: computed by the CPU where stored (CC),
    stored on the host and computed on the GPU (CG), resident (GG)."""

    CC = "cc"
    CG = "cg"
    GG = "gg"

    def __str__(self) -> str:
        return self.value


class SlicingMode(Mode):
    """--mlp-slicing's kinds: off, rates solved at start (auto), or rates given (CC,CG)."""

    OFF = "off"
    AUTO = "auto"
    FIXED = "fixed"


# What --mlp-slicing accepts, for its messages.
_SLICING_WORDS = "off, auto or CC,CG with rates summing to at most 1"
_SLICING_HINT = "CC,CG are the CPU-computed and the streamed share of each MLP, e.g. 0.25,0.5"


@dataclass(frozen=True)
class MlpSlicing:
    """--mlp-slicing as a value: off; auto (each layer's rates solved at start, ScheInfer sec.
    IV-A); or fixed rates, one SliceRates for every layer or one per layer."""

    mode: SlicingMode = SlicingMode.OFF
    rates: tuple[SliceRates, ...] = ()  # FIXED only

    def __post_init__(self) -> None:
        if (self.mode == SlicingMode.FIXED) != bool(self.rates):
            raise ValueError(f"slicing {self.mode} takes {'' if self.mode == SlicingMode.FIXED else 'no '}rates, "
                             f"got {self.rates!r}")

    @classmethod
    def parse(cls, value: "MlpSlicing | str | SliceRates | tuple[SliceRates, ...] | list[SliceRates]") -> "MlpSlicing":
        """The flag's text ("off", "auto", "CC,CG": GG the rest), SliceRates for every layer, one per
        layer, or an MlpSlicing; ValueError saying what it takes otherwise."""
        if isinstance(value, MlpSlicing):
            return value
        if isinstance(value, SliceRates):
            return cls(SlicingMode.FIXED, (value,))
        if isinstance(value, str):
            return cls._parse_text(value)
        if isinstance(value, (tuple, list)) and value and all(isinstance(rates, SliceRates) for rates in value):
            return cls(SlicingMode.FIXED, tuple(value))
        raise ValueError(f"must be off, auto, CC,CG (e.g. 0.25,0.5) or one SliceRates per layer, got {value!r}")

    @classmethod
    def _parse_text(cls, value: str) -> "MlpSlicing":
        text = value.strip().lower()
        if text in (SlicingMode.OFF, SlicingMode.AUTO):
            return cls(SlicingMode(text))
        try:
            cc, cg = (float(part) for part in text.split(","))
            return cls(SlicingMode.FIXED, (SliceRates(cc, cg, max(0.0, 1.0 - cc - cg)),))
        except ValueError as exc:
            raise ValueError(f"must be {_SLICING_WORDS}, got {value!r} ({exc}); {_SLICING_HINT}") from None

    @property
    def enabled(self) -> bool:
        return self.mode != SlicingMode.OFF

    @property
    def solved(self) -> bool:
        """auto: the engine solves each layer's rates at start."""
        return self.mode == SlicingMode.AUTO

    def layer_rates(self, num_layers: int) -> tuple[SliceRates, ...] | None:
        """Each of `num_layers` layers' fixed rates; None when off or solved at start."""
        if self.mode != SlicingMode.FIXED:
            return None
        if len(self.rates) == 1:
            return self.rates * num_layers
        if len(self.rates) != num_layers:
            raise ValueError(f"gives slice rates for {len(self.rates)} layers, but the model has {num_layers}")
        return self.rates

    def __str__(self) -> str:
        if self.mode != SlicingMode.FIXED:
            return str(self.mode)
        return ";".join(f"{rates.cc:g},{rates.cg:g}" for rates in self.rates)


def ring_size(num_layer_buffers: int, layer_bytes: int, largest_cg_bytes: int) -> tuple[int, int]:
    """The one ring of GPU buffers that layers streamed whole and CG parts pass through, as
    (buffers, bytes of each): the whole-layer pipeline's `num_layer_buffers`, at least
    NUM_CG_BUFFERS where a CG part streams, each holding the largest thing that passes (a layer
    image, else the largest CG part); (0, 0) where nothing streams."""
    num_buffers = max(num_layer_buffers, NUM_CG_BUFFERS if largest_cg_bytes else 0)
    if not num_buffers:
        return 0, 0
    return num_buffers, max(layer_bytes if num_layer_buffers else 0, largest_cg_bytes)
