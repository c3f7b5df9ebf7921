"""Weight placement: which decoder layers live on the accelerator, in host memory or on disk,
and which pipeline streams them (PIPO sec. 3.5). Plain Python, no torch: `tandem plan` and the
engine ask the same planner."""
from scheduler.placement.memory import (
    GIB_BYTES,
    IMAGE_ALIGN_BYTES,
    IMAGE_TENSOR_ALIGN_BYTES,
    MemoryBreakdown,
    WeightFormat,
    image_layout,
    layer_image_bytes,
)
from scheduler.placement.pipeline import ForwardTimeline, simulate_forward
from scheduler.placement.planner import (
    PIPELINE_CHOICES,
    PIPELINE_MEMORY,
    PIPELINE_PERFORMANCE,
    PLACEMENT_MODES,
    TIER_ACCELERATOR,
    TIER_DISK,
    TIER_HOST,
    ComputeCosts,
    MemoryBudgets,
    PlacementError,
    PlannerInputs,
    ThroughputEstimate,
    TransferRates,
    WeightPlacement,
    Workload,
    describe,
    plan_placement,
)

__all__ = ["ComputeCosts", "ForwardTimeline", "GIB_BYTES", "IMAGE_ALIGN_BYTES", "IMAGE_TENSOR_ALIGN_BYTES",
           "MemoryBreakdown", "MemoryBudgets", "PIPELINE_CHOICES", "PIPELINE_MEMORY", "PIPELINE_PERFORMANCE",
           "PLACEMENT_MODES", "PlacementError", "PlannerInputs", "TIER_ACCELERATOR", "TIER_DISK", "TIER_HOST",
           "ThroughputEstimate", "TransferRates", "WeightFormat", "WeightPlacement", "Workload", "describe",
           "image_layout", "layer_image_bytes", "plan_placement", "simulate_forward"]
