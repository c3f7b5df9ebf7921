"""The slicing plan: per decoder layer, the CC/CG/GG rates of its MLP for the decode phase within
the GPU's weight budget (ScheInfer sec. IV-A), with their predicted times; what the
engine executes and `tandem plan` prints. Plain Python, no torch.

Under slicing the attention weights, embeddings, head and norms stay resident (as in ScheInfer,
which slices MLPs only), and so do a MoE layer's router and shared expert; the MLPs (a MoE layer's
routed experts, cut by whole experts) share what the budget leaves: each layer's GG part is
resident, and a ring of NUM_CG_BUFFERS buffers of the largest CG part receives the CG slices.
With a prefill's token assignment (`prefill_tokens`), one more buffer of the largest dense CC
part receives CG' (CC's weights, copied for the tokens moved off the CPU); solved rates are
solved within what it leaves, and where no rates fit beside it the plan moves no tokens. Rates
come from the greedy (eq. 14) over GG candidates in eighths (whole experts for MoE), each solved
for its best CC rate at the decode batch; or fixed rates (`--mlp-slicing CC,CG`) everywhere.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Sequence

from scheduler.planning.cost_model import ModelShape
from scheduler.planning.memory import (
    ALWAYS_DENSE_LINEARS,
    GIB_BYTES,
    WeightFormat,
    layer_image_bytes,
    linear_shapes,
    resident_global_bytes,
)
from scheduler.planning.placement import PlacementError
from scheduler.planning.slicing.rates import SliceRates, ring_size
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.slicing.model import MlpWork, dense_mlp_work, layer_time_s, moe_mlp_work
from scheduler.planning.slicing.solver import (
    LayerChoices,
    assign_gg,
    rate_steps,
    layer_choices,
    solve_moved_tokens,
)


@dataclass(frozen=True)
class SlicingPlan:
    """Per sliced decoder layer (`layers`; the others stream whole), its MLP's rates and predicted
    time at `num_tokens` decode tokens; the GPU bytes they take; and, for a prefill of
    `prefill_tokens`, the tokens each layer moves to CG' and its predicted time then."""

    layers: tuple[int, ...]  # the layers sliced, ascending; the tuples below follow them
    rates: tuple[SliceRates, ...]
    layer_time_s: tuple[float, ...]
    num_tokens: int
    mlp_bytes: int  # the largest layer's MLP weights (a MoE layer's routed experts) as stored
    resident_bytes: int  # every sliced layer's GG part
    fixed_bytes: int  # embeddings, head and norms, and the sliced layers' attention weights
    budget_bytes: int | None
    # the ring the CG parts stream through, shared with the layers streamed whole (slicing.ring_size)
    num_ring_buffers: int = 0
    ring_buffer_bytes: int = 0  # one of its buffers
    prefill_tokens: int | None = None
    moved_tokens: tuple[int, ...] = ()
    prefill_time_s: tuple[float, ...] = ()
    moved_buffer_bytes: int = 0  # where CG' lands: the largest CC part of a layer cut by units

    @property
    def buffer_bytes(self) -> int:
        """The whole ring; 0 when nothing streams."""
        return self.num_ring_buffers * self.ring_buffer_bytes

    @property
    def gpu_weight_bytes(self) -> int:
        return self.fixed_bytes + self.resident_bytes + self.buffer_bytes + self.moved_buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "rates": [[r.cc, r.cg, r.gg] for r in self.rates],
                "layer_time_s": list(self.layer_time_s), "num_tokens": self.num_tokens, "mlp_bytes": self.mlp_bytes,
                "resident_bytes": self.resident_bytes, "buffer_bytes": self.buffer_bytes,
                "num_ring_buffers": self.num_ring_buffers, "ring_buffer_bytes": self.ring_buffer_bytes,
                "fixed_bytes": self.fixed_bytes, "gpu_weight_bytes": self.gpu_weight_bytes,
                "budget_bytes": self.budget_bytes, "prefill_tokens": self.prefill_tokens,
                "moved_tokens": list(self.moved_tokens), "prefill_time_s": list(self.prefill_time_s),
                "moved_buffer_bytes": self.moved_buffer_bytes}


# What a MoE layer keeps resident beside its routed experts: the router, and the shared expert
# with its gate where the family has one (memory.linear_shapes' names).
MOE_RESIDENT_LINEARS = ("router", "shared_expert.gate_up", "shared_expert.down", "shared_expert_gate")


def fixed_weight_bytes(shape: ModelShape, fmt: WeightFormat, layers: Sequence[int] | None = None) -> int:
    """What slicing leaves resident: embeddings, head and norms, and each of `layers`' (None: every
    layer's) QKV (with its bias) and O projections and, in a MoE layer, its router and shared expert."""
    shapes = linear_shapes(shape)
    layers = range(shape.num_layers) if layers is None else layers

    def stored(names) -> int:
        dense = WeightFormat("none", fmt.dtype_bytes)
        return sum(sum((dense if name in ALWAYS_DENSE_LINEARS else fmt).linear_tensor_bytes(*shapes[name]))
                   for name in names if name in shapes)
    attention = stored(("qkv", "o_proj"))
    if shape.attention_bias:
        attention += shapes["qkv"][0] * fmt.dtype_bytes
    num_moe_layers = sum(shape.is_moe_layer(layer) for layer in layers)
    return (resident_global_bytes(shape, fmt.dtype_bytes) + len(layers) * attention +
            num_moe_layers * stored(MOE_RESIDENT_LINEARS))


def layer_works(shape: ModelShape, fmt: WeightFormat, num_tokens: int) -> list[MlpWork]:
    """Each decoder layer's sliced work at a token count: a dense MLP, or a MoE layer's routed
    experts (sliced by whole experts)."""
    dense = dense_mlp_work(shape.hidden_size, shape.intermediate_size, num_tokens, fmt)
    if not shape.is_moe:
        return [dense] * shape.num_layers
    experts = moe_mlp_work(shape.hidden_size, shape.expert_intermediate_size, shape.num_experts,
                           shape.num_experts_per_token, num_tokens, fmt)
    return [experts if shape.is_moe_layer(layer) else dense for layer in range(shape.num_layers)]


@dataclass(frozen=True)
class _Problem:
    """What one slicing solves over: the sliced layers' works, what stays resident beside them,
    the budget, and the whole-layer buffers the ring already has (their count and one layer's bytes)."""

    layers: tuple[int, ...]
    works: tuple[MlpWork, ...]
    costs: SlicingCosts
    fixed_bytes: int
    budget_bytes: int | None
    num_layer_buffers: int
    layer_bytes: int

    def ring_bytes(self, largest_cg_bytes: int) -> int:
        num_buffers, buffer_bytes = ring_size(self.num_layer_buffers, self.layer_bytes, largest_cg_bytes)
        return num_buffers * buffer_bytes


def plan_slicing(shape: ModelShape, fmt: WeightFormat, costs: SlicingCosts, gpu_weight_bytes: int | None,
                 num_tokens: int, fixed_rates: SliceRates | Sequence[SliceRates] | None = None,
                 prefill_tokens: int | None = None, layers: Sequence[int] | None = None,
                 num_layer_buffers: int = 0) -> SlicingPlan:
    """Rates for `layers` (None: every layer) for decode batches of `num_tokens` within
    `gpu_weight_bytes` (None: unbounded), solved, or `fixed_rates` (one for all, or one per
    sliced layer); PlacementError when they cannot fit. The other layers stream whole through
    `num_layer_buffers` buffers of a layer image, the ring the CG parts share (slicing.ring_size):
    the budget holds the embeddings, head and norms once, the sliced layers' attention and parts,
    and that ring."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    layers = tuple(range(shape.num_layers)) if layers is None else tuple(layers)
    if not layers:
        raise ValueError("plan_slicing needs at least one layer to slice")
    all_works = layer_works(shape, fmt, num_tokens)
    works = tuple(all_works[layer] for layer in layers)
    fixed = fixed_weight_bytes(shape, fmt, layers)
    budget = gpu_weight_bytes
    problem = _Problem(layers, works, costs, fixed, budget, num_layer_buffers,
                       layer_image_bytes(shape, fmt) if num_layer_buffers else 0)
    if isinstance(fixed_rates, SliceRates):
        rates = [fixed_rates] * len(layers)
    elif fixed_rates is not None:
        rates = list(fixed_rates)
        if len(rates) != len(layers):
            raise ValueError(f"{len(rates)} fixed rates for {len(layers)} sliced layers")
    else:
        rates = _solve_rates(problem)
    plan = _plan_of(problem, rates)
    solved = fixed_rates is None and budget is not None
    prefill_works = None if prefill_tokens is None else [layer_works(shape, fmt, prefill_tokens)[layer]
                                                         for layer in layers]
    moving = None
    if prefill_works is not None and any(moved for moved, _ in _prefill(prefill_works, costs, plan.rates, True)):
        moving = _with_moved_buffer(problem, plan, solved)  # room for CG' only where a prefill moves tokens
    plan = moving or plan
    if budget is not None and plan.gpu_weight_bytes > budget:
        raise PlacementError(f"MLP slicing needs {_gib(plan.gpu_weight_bytes)} of GPU memory for "
                             f"weights (attention, embeddings, head and norms {_gib(fixed)}, resident MLP parts "
                             f"{_gib(plan.resident_bytes)}, the ring streamed parts{_and_layers(problem)} pass "
                             f"through {_gib(plan.buffer_bytes)}) but --weights-gpu-gib gives {_gib(budget)}; give "
                             f"more, or lower GG in --mlp-slicing")
    if prefill_tokens is None:
        return plan
    prefill = _prefill(prefill_works, costs, plan.rates, moving is not None)
    return dataclasses.replace(plan, prefill_tokens=prefill_tokens, moved_tokens=tuple(moved for moved, _ in prefill),
                               prefill_time_s=tuple(time_s for _, time_s in prefill))


def _and_layers(problem: _Problem) -> str:
    return " and layers streamed whole" if problem.num_layer_buffers else ""


def _prefill(works: Sequence[MlpWork], costs: SlicingCosts, rates: Sequence[SliceRates],
             moving: bool) -> list[tuple[int, float]]:
    """Each layer's tokens moved to CG' in a prefill and its time then: solved where tokens move
    (a layer cut by units; a MoE layer's CC experts keep every routed row), else none moved."""
    return [solve_moved_tokens(work, costs, layer_rates) if moving and not work.num_experts
            else (0, layer_time_s(work, costs, layer_rates)) for work, layer_rates in zip(works, rates)]


def largest_cg_bytes(works: Sequence[MlpWork], rates: Sequence[SliceRates]) -> int:
    """The largest CG part: what each of the ring's buffers must hold for the sliced layers."""
    return max(round(r.cg * work.weight_bytes) for work, r in zip(works, rates))


def moved_buffer_bytes(works: Sequence[MlpWork], rates: Sequence[SliceRates]) -> int:
    """The GPU buffer CG' copies CC's weights into: the largest CC part of a layer cut by
    units (a MoE layer's CC experts take no moved rows)."""
    return max((round(r.cc * work.weight_bytes) for work, r in zip(works, rates) if not work.num_experts), default=0)


def _with_moved_buffer(problem: _Problem, plan: SlicingPlan, solved: bool) -> SlicingPlan | None:
    """The plan with CG''s buffer beside its parts (solved rates: solved again within what the
    buffer leaves); None where the budget has no room for it. The buffer's size follows the CC
    rates solved, so the room kept for it grows to what the last rates need until they fit it
    (each round keeps more, of finitely many sizes)."""
    reserved = 0
    while True:
        needed = moved_buffer_bytes(problem.works, plan.rates)
        if needed <= reserved or not solved:
            moving = dataclasses.replace(plan, moved_buffer_bytes=needed)
            fits = plan.budget_bytes is None or moving.gpu_weight_bytes <= plan.budget_bytes
            return moving if fits else None
        reserved = needed
        try:
            rates = _solve_rates(problem, reserved)
        except PlacementError:
            return None
        plan = _plan_of(problem, rates)


def _solve_rates(problem: _Problem, reserved_bytes: int = 0) -> list[SliceRates]:
    """Unbounded: each layer's fastest rates. Else the fastest, of those that fit beside
    `reserved_bytes`, of every MLP resident (which needs no CG buffer) and, for each cap on the CG
    rate, the greedy's rates (eq. 14) within what the budget leaves beside the ring that cap needs:
    the ring grows with CG, the resident parts with GG, and CC takes neither."""
    works, costs, budget = list(problem.works), problem.costs, problem.budget_bytes
    if budget is None:
        return [layer.solved[_fastest(layer)].rates for layer in _choices(works, costs, 1.0)]
    fixed = problem.fixed_bytes + reserved_bytes
    fitting = []
    if fixed + sum(work.weight_bytes for work in works) + problem.ring_bytes(0) <= budget:
        fitting.append([SliceRates.resident()] * len(works))
    for max_cg in sorted({cap for work in set(works) for cap in rate_steps(work)}):
        gg_budget = budget - fixed - problem.ring_bytes(max(round(max_cg * work.weight_bytes) for work in works))
        if gg_budget < 0:  # no room for the ring this cap needs, whatever the resident parts
            continue
        choices = _choices(works, costs, max_cg)
        if gg_budget >= sum(layer.resident_bytes[0] for layer in choices):
            fitting.append([layer.solved[index].rates for layer, index in zip(choices, assign_gg(choices, gg_budget))])
    if not fitting:
        ring = (f" and {problem.num_layer_buffers} buffers of {_gib(problem.layer_bytes)} for the layers streamed "
                f"whole" if problem.num_layer_buffers else "")
        raise PlacementError(f"MLP slicing needs attention, embeddings, head and norms ({_gib(problem.fixed_bytes)})"
                             f"{ring} on the GPU and room for MLP parts, but --weights-gpu-gib gives "
                             f"{_gib(budget)}; give more")
    return min(fitting, key=lambda rates: _total_s(works, costs, rates))


def _choices(works: list[MlpWork], costs: SlicingCosts, max_cg: float) -> list[LayerChoices]:
    """Each layer's candidates, solved once per distinct work."""
    return [_layer_choices(work, costs, max_cg) for work in works]


@functools.lru_cache(maxsize=256)
def _layer_choices(work: MlpWork, costs: SlicingCosts, max_cg: float) -> LayerChoices:
    """A work's candidates, solved once per distinct work, costs and cap: the joint planner
    (model_plan.py) slices the same layers again for each number of layers it streams whole."""
    return layer_choices(work, costs, rate_steps(work), max_cg)


def _fastest(layer: LayerChoices) -> int:
    return min(range(len(layer.solved)), key=lambda i: (layer.solved[i].time_s, i))


def _total_s(works: list[MlpWork], costs: SlicingCosts, rates: list[SliceRates]) -> float:
    return sum(layer_time_s(work, costs, layer_rates) for work, layer_rates in zip(works, rates))


def _plan_of(problem: _Problem, rates: Sequence[SliceRates]) -> SlicingPlan:
    works = problem.works
    resident = sum(round(r.gg * work.weight_bytes) for work, r in zip(works, rates))
    num_ring_buffers, ring_buffer_bytes = ring_size(problem.num_layer_buffers, problem.layer_bytes,
                                                    largest_cg_bytes(works, rates))
    return SlicingPlan(problem.layers, tuple(rates),
                       tuple(layer_time_s(work, problem.costs, r) for work, r in zip(works, rates)),
                       works[0].num_tokens, max(work.weight_bytes for work in works), resident, problem.fixed_bytes,
                       problem.budget_bytes, num_ring_buffers, ring_buffer_bytes)


def _gib(num_bytes: float) -> str:
    """GiB to two places, or MiB where that would round small sizes away."""
    if num_bytes < 0.1 * GIB_BYTES:
        return f"{num_bytes / 2**20:.2f} MiB"
    return f"{num_bytes / GIB_BYTES:.2f} GiB"


def layer_ranges(layers: Sequence[int]) -> str:
    """Ascending layer indices as runs: "0-3, 5, 7-9"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def describe_slicing(plan: SlicingPlan) -> str:
    """The rates and predicted MLP times, layers of equal rates on one line, as `tandem plan` prints."""
    ring = (f"ring {_gib(plan.buffer_bytes)} ({plan.num_ring_buffers} buffer{'s' if plan.num_ring_buffers > 1 else ''}"
            f" of {_gib(plan.ring_buffer_bytes)})" if plan.num_ring_buffers else "no ring")
    lines = [f"MLP slicing (ScheInfer): decode batch {plan.num_tokens}; per layer the MLP's CC (CPU) / CG "
             f"(streamed) / GG (resident) rates and its predicted time",
             f"  GPU weights {_gib(plan.gpu_weight_bytes)}: attention, embeddings, head and norms "
             f"{_gib(plan.fixed_bytes)}, resident MLP parts {_gib(plan.resident_bytes)}, {ring}, CG' buffer "
             f"{_gib(plan.moved_buffer_bytes)}" + (f" (budget {_gib(plan.budget_bytes)})" if plan.budget_bytes else "")]
    groups: dict[tuple, list[int]] = {}  # positions in plan.layers, by what a line shows
    for position, rates in enumerate(plan.rates):
        key = (rates, plan.layer_time_s[position], *(plan.moved_tokens[position:position + 1]),
               *(plan.prefill_time_s[position:position + 1]))
        groups.setdefault(key, []).append(position)
    for positions in groups.values():
        first = positions[0]
        r = plan.rates[first]
        names = layer_ranges([plan.layers[position] for position in positions])
        label = f"layer{'s' if len(positions) > 1 else ''} {names}"
        line = f"  {label:<14} CC {r.cc:.3f}  CG {r.cg:.3f}  GG {r.gg:.3f}  {plan.layer_time_s[first] * 1e3:.3f} ms"
        if plan.prefill_tokens:
            line += (f"; prefill of {plan.prefill_tokens}: {plan.moved_tokens[first]} tokens on CG', "
                     f"{plan.prefill_time_s[first] * 1e3:.2f} ms")
        lines.append(line)
    lines.append(f"  MLPs of one decode step: {sum(plan.layer_time_s) * 1e3:.2f} ms predicted")
    return "\n".join(lines)
