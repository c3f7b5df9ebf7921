"""Planning, torch-free: where each decoder layer's weights live and which pipeline streams them
(PIPO, placement.py), how MLPs are sliced (slicing/, ScheInfer) and experts cached (experts/), the fit
of formats and pools to two budgets (fit/, LM-Offload), the host's threads (threads.py), over the
cost models the schedulers share (cost_model.py). `tandem plan` and the engine ask the same planners."""
from scheduler.planning.layer_plan import LayerPlan, ModelPlan, SliceKind, Tier, ring_size
from scheduler.planning.memory import (
    GIB_BYTES,
    IMAGE_ALIGN_BYTES,
    IMAGE_TENSOR_ALIGN_BYTES,
    MemoryBreakdown,
    WeightFormat,
    image_layout,
    layer_image_bytes,
)
from scheduler.planning.pipeline import ForwardTimeline, simulate_forward
from scheduler.planning.slicing.rates import MlpSlicing, SliceRates, SlicingMode
from scheduler.planning.slicing.cost import GemmCost, LinearCost, SlicingCosts, fit_gemm_cost, fit_linear_cost
from scheduler.planning.slicing.model import GemmWork, MlpWork, dense_mlp_work, layer_time_s, moe_mlp_work
from scheduler.planning.slicing.plan import SlicingPlan, describe_slicing, plan_slicing
from scheduler.planning.slicing.solver import assign_gg, layer_choices, solve_cc, solve_moved_tokens
from scheduler.planning.placement import (
    PIPELINE_MEMORY,
    PIPELINE_PERFORMANCE,
    TIER_GPU,
    TIER_DISK,
    TIER_HOST,
    ComputeCosts,
    MemoryBudgets,
    PlacementError,
    PlacementMode,
    PlannerInputs,
    ThroughputEstimate,
    TransferRates,
    WeightPipeline,
    WeightPlacement,
    Workload,
    describe,
    plan_placement,
)
from scheduler.planning.model_plan import (
    PlacementRequest,
    SlicingRequest,
    describe_model_plan,
    plan_model,
)

__all__ = ["ComputeCosts", "ForwardTimeline", "GIB_BYTES", "GemmCost", "GemmWork", "IMAGE_ALIGN_BYTES", "IMAGE_TENSOR_ALIGN_BYTES",
           "LayerPlan", "LinearCost", "MemoryBreakdown", "MemoryBudgets", "MlpSlicing", "MlpWork", "ModelPlan",
           "PIPELINE_MEMORY", "PIPELINE_PERFORMANCE", "PlacementError", "PlacementMode", "PlacementRequest",
           "PlannerInputs", "SliceKind", "SliceRates", "SlicingCosts", "SlicingMode", "SlicingPlan", "SlicingRequest",
           "TIER_GPU", "TIER_DISK", "TIER_HOST", "ThroughputEstimate", "Tier", "TransferRates", "WeightFormat",
           "WeightPipeline", "WeightPlacement", "Workload", "assign_gg", "dense_mlp_work", "describe", "describe_model_plan",
           "describe_slicing", "fit_gemm_cost", "fit_linear_cost", "image_layout", "layer_choices", "layer_image_bytes",
           "layer_time_s", "moe_mlp_work", "plan_model", "plan_placement", "plan_slicing",
           "ring_size", "simulate_forward", "solve_cc", "solve_moved_tokens"]
