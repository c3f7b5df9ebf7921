"""Weight placement: which decoder layers live on the GPU, in host memory or on disk,
and which pipeline streams them (PIPO sec. 3.5); and ScheInfer's slicing of each MLP into parts
computed on the CPU, streamed, and resident (slicing*.py). Plain Python, no torch: `tandem plan`
and the engine ask the same planner."""
from scheduler.placement.layer_plan import LayerPlan, ModelPlan, SliceKind, Tier, ring_size
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
from scheduler.placement.slicing import SliceRates
from scheduler.placement.slicing_cost import GemmCost, LinearCost, SlicingCosts, fit_gemm_cost, fit_linear_cost
from scheduler.placement.slicing_model import GemmWork, MlpWork, dense_mlp_work, layer_time_s, moe_mlp_work
from scheduler.placement.slicing_plan import SlicingPlan, describe_slicing, parse_mlp_slicing, plan_slicing
from scheduler.placement.slicing_solver import assign_gg, layer_choices, solve_cc, solve_moved_tokens
from scheduler.placement.planner import (
    PIPELINE_CHOICES,
    PIPELINE_MEMORY,
    PIPELINE_PERFORMANCE,
    PLACEMENT_MODES,
    TIER_GPU,
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
from scheduler.placement.model_plan import (
    PlacementRequest,
    SlicingRequest,
    describe_model_plan,
    plan_model,
)

__all__ = ["ComputeCosts", "ForwardTimeline", "GIB_BYTES", "GemmCost", "GemmWork", "IMAGE_ALIGN_BYTES", "IMAGE_TENSOR_ALIGN_BYTES",
           "LayerPlan", "LinearCost", "MemoryBreakdown", "MemoryBudgets", "MlpWork", "ModelPlan", "PIPELINE_CHOICES",
           "PIPELINE_MEMORY", "PIPELINE_PERFORMANCE", "PLACEMENT_MODES", "PlacementError", "PlacementRequest",
           "PlannerInputs", "SliceKind", "SliceRates", "SlicingCosts", "SlicingPlan", "SlicingRequest",
           "TIER_GPU", "TIER_DISK", "TIER_HOST", "ThroughputEstimate", "Tier", "TransferRates", "WeightFormat",
           "WeightPlacement", "Workload", "assign_gg", "dense_mlp_work", "describe", "describe_model_plan",
           "describe_slicing", "fit_gemm_cost", "fit_linear_cost", "image_layout", "layer_choices", "layer_image_bytes",
           "layer_time_s", "moe_mlp_work", "parse_mlp_slicing", "plan_model", "plan_placement", "plan_slicing",
           "ring_size", "simulate_forward", "solve_cc", "solve_moved_tokens"]
