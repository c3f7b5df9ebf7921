"""One plan for the whole model: for each decoder layer, where its weights live and what its MLP
is. The placement planner (whole layers streamed, PIPO) and the slicing planner (MLPs cut into
CC/CG/GG parts, ScheInfer) each decide part of it; `ModelPlan` is what the engine executes and
`tandem plan` prints. Plain Python, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from scheduler.planning.slicing.rates import SliceKind, SliceRates, ring_size
from scheduler.planning.tiers import Tier

if TYPE_CHECKING:
    from scheduler.planning.experts.hot_experts import ExpertCachePlan
    from scheduler.planning.placement import WeightPlacement
    from scheduler.planning.slicing.plan import SlicingPlan


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer: `tier` holds its weights (attention always; the MLP too unless sliced);
    a streamed layer (host or disk) streams whole. `rates` slice the MLP of a resident layer
    (a MoE layer's routed experts by whole experts); None: the MLP lives with the layer."""

    tier: Tier
    rates: SliceRates | None = None

    def __post_init__(self) -> None:
        if self.rates is not None and self.tier != Tier.GPU:
            raise ValueError(f"a layer streamed whole from {self.tier} is not sliced")

    @property
    def streamed(self) -> bool:
        return self.tier != Tier.GPU

    @property
    def sliced(self) -> bool:
        """Whether part of the MLP lives off the GPU."""
        return self.rates is not None and self.rates != SliceRates.resident()


@dataclass(frozen=True)
class ModelPlan:
    """Every decoder layer's plan, with the planners' decisions behind it: `placement` (whole-layer
    streaming: pipeline, ring, memory, estimate; None where the placement planner did not run)
    and `slicing` (the sliced layers' rates and predicted MLP times; None without slicing).

    Layers streamed whole and CG parts pass through one ring of `num_ring_buffers` GPU
    buffers of `ring_buffer_bytes` each (`ring_size`); `gpu_weight_bytes` counts it once
    beside the globals, the resident layers or their attention and GG parts, and CG''s buffer
    (None where unknown), within `budget_bytes` (--weights-gpu-gib; None: no bound)."""

    layers: tuple[LayerPlan, ...]
    placement: WeightPlacement | None = None
    slicing: SlicingPlan | None = None
    num_ring_buffers: int = 0
    ring_buffer_bytes: int = 0
    gpu_weight_bytes: int | None = None
    budget_bytes: int | None = None
    # a MoE model's hot-expert cache (every routed layer's experts in GPU slots and host memory;
    # the layers otherwise resident); None: experts placed by the layers' rates, or all resident
    experts: ExpertCachePlan | None = None

    @classmethod
    def compose(cls, num_layers: int, placement: WeightPlacement | None = None,
                rates: Sequence[SliceRates] | None = None, slicing: SlicingPlan | None = None) -> "ModelPlan":
        """The plan of `placement`'s tiers (every layer resident without one) with `rates` (one per
        layer) slicing the resident layers' MLPs; layers streamed whole are not sliced."""
        tiers = [Tier(tier) for tier in placement.tiers] if placement is not None else [Tier.GPU] * num_layers
        if rates is not None and len(rates) != num_layers:
            raise ValueError(f"slice rates for {len(rates)} layers, but the model has {num_layers}")
        layers = tuple(LayerPlan(tier, rates[i] if rates is not None and tier == Tier.GPU else None)
                       for i, tier in enumerate(tiers))
        return cls(layers, placement, slicing)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(layer.tier for layer in self.layers)

    @property
    def rates(self) -> tuple[SliceRates, ...] | None:
        """Each layer's slice rates (resident ones for layers not sliced); None when nothing is sliced."""
        if all(layer.rates is None for layer in self.layers):
            return None
        return tuple(layer.rates or SliceRates.resident() for layer in self.layers)

    @property
    def streamed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.streamed)

    @property
    def sliced_layers(self) -> tuple[int, ...]:
        return tuple(i for i, layer in enumerate(self.layers) if layer.sliced)

    def num_layers_in(self, tier: Tier) -> int:
        return sum(layer.tier == tier for layer in self.layers)

    @property
    def all_resident(self) -> bool:
        return not self.streamed_layers and not self.sliced_layers and self.experts is None

    @property
    def ring_bytes(self) -> int:
        return self.num_ring_buffers * self.ring_buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        report: dict[str, Any] = {"layers": [{"tier": str(layer.tier), "rates": None if layer.rates is None else
                                              [layer.rates.cc, layer.rates.cg, layer.rates.gg]}
                                             for layer in self.layers],
                                  "ring": {"num_buffers": self.num_ring_buffers,
                                           "buffer_bytes": self.ring_buffer_bytes},
                                  "gpu_weight_bytes": self.gpu_weight_bytes,
                                  "budget_bytes": self.budget_bytes}
        if self.placement is not None:
            report["placement"] = self.placement.to_dict()
        if self.slicing is not None:
            report["slicing"] = self.slicing.to_dict()
        if self.experts is not None:
            report["hot_experts"] = self.experts.to_dict()
        return report
