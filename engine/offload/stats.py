"""What the weight parts did, as running totals the engine reads around each forward: the ring's
loads (PIPO's streamed layers and ScheInfer's CG parts), the CPU side's MLP parts (CC), CG''s
moved tokens, and the hot-expert cache's pairs and copies. The parts write into one `WeightStats`
they are given; nothing reads them back through the layer store."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from scheduler.planning.tiers import Tier


@dataclass
class WeightStats:
    """Running totals since start (seconds, bytes, counts). `streams`, `slices`, `moves`, `experts` say
    which parts exist, so a report can tell "none happened" from "nothing could"."""

    streams: bool = False  # a ring loads weights
    slices: bool = False  # a CPU side computes MLP parts (CC)
    moves: bool = False  # CG' computes CC's units for moved tokens
    # ---- the ring ------------------------------------------------------------------------------
    bytes_by_tier: dict[Tier, int] = field(default_factory=lambda: {Tier.HOST: 0, Tier.DISK: 0})
    transfer_s: float = 0.0  # loads in progress, summed
    stall_s: float = 0.0  # acquires waiting on a load
    num_loads: int = 0
    # ---- the CPU side's MLP parts ----------------------------------------------------------------
    num_cc_calls: int = 0
    cc_s: float = 0.0  # CC's gate/up, activation and down, on the CPU
    cc_thread_ids: set[int] = field(default_factory=set)  # the threads that computed CC
    num_cc_tokens: int = 0  # rows summed over dense layers: CC's units computed by the CPU
    # ---- CG' -----------------------------------------------------------------------------------
    num_moved_tokens: int = 0  # rows summed over dense layers: CC's units computed by CG' instead
    moved_bytes: int = 0  # CC's weights copied to the GPU for CG'
    moved_thread_ids: set[int] = field(default_factory=set)  # the threads that computed CG'
    moved_copy_thread_ids: set[int] = field(default_factory=set)  # the threads that copied CG''s weights
    # ---- the hot-expert cache (routed pairs summed over layers; the CPU's share in cc_s) ---------
    experts: bool = False  # a MoE model's experts pass through the hot-expert cache
    num_hit_pairs: int = 0  # routed to an expert in a GPU slot
    num_miss_pairs: int = 0  # routed to one that is not
    num_fetched_pairs: int = 0  # misses computed on the GPU from a fetch buffer (the rest: by the CPU)
    num_hit_pairs_on_cpu: int = 0  # hits the CPU computed, the GPU having more than its share
    gpu_expert_s: float = 0.0  # the GPU computing its experts, where its queue runs them in line (testbed)
    num_expert_promotions: int = 0
    num_expert_demotions: int = 0
    promoted_bytes: int = 0
    fetched_bytes: int = 0
    expert_copy_thread_ids: set[int] = field(default_factory=set)  # the threads that fetched experts

    def snapshot(self) -> "WeightStats":
        return copy.deepcopy(self)

    def copy_from(self, other: "WeightStats") -> None:
        """Take `other`'s totals (a tensor-parallel rank's, reported to the driver)."""
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(other, name))
