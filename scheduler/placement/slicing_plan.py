"""The slicing plan: per decoder layer, the CC/CG/GG rates of its MLP for the decode phase within
the accelerator's weight budget (ScheInfer sec. IV-A), with their predicted times; what the
engine executes and `tandem plan` prints. Plain Python, no torch.

Under slicing the attention weights, embeddings, head and norms stay resident (as in ScheInfer,
which slices MLPs only); the MLPs share what the budget leaves: each layer's GG part is resident
and one accelerator buffer of a whole MLP's bytes receives the CG slices (and a prefill's CG',
which is CC's weights, so one MLP's bytes hold both). Rates come from the greedy (eq. 14) over
GG candidates in eighths, each solved for its best CC rate at the decode batch; or fixed rates
(`--mlp-slicing CC,CG`) everywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from scheduler.cost_model import ModelShape
from scheduler.placement.memory import GIB_BYTES, WeightFormat, linear_shapes, resident_global_bytes
from scheduler.placement.planner import PlacementError
from scheduler.placement.slicing import SliceRates
from scheduler.placement.slicing_cost import SlicingCosts
from scheduler.placement.slicing_model import MlpWork, dense_mlp_work, layer_time_s
from scheduler.placement.slicing_solver import LayerChoices, assign_gg, layer_choices, solve_moved_tokens

SLICING_OFF = "off"
SLICING_AUTO = "auto"
DEFAULT_GG_RATES = tuple(i / 8 for i in range(9))


def parse_mlp_slicing(value: str) -> SliceRates | str:
    """`--mlp-slicing`: "off", "auto" (solved), or "CC,CG" (fixed rates, GG the rest)."""
    text = value.strip().lower()
    if text in (SLICING_OFF, SLICING_AUTO):
        return text
    try:
        cc, cg = (float(part) for part in text.split(","))
        return SliceRates(cc, cg, max(0.0, 1.0 - cc - cg))
    except ValueError as exc:
        raise ValueError(f"--mlp-slicing must be off, auto or CC,CG with rates summing to at most 1, "
                         f"got {value!r} ({exc})") from None


@dataclass(frozen=True)
class SlicingPlan:
    """Per decoder layer, its MLP's rates and predicted time at `num_tokens` decode tokens; the
    accelerator bytes they take; and, for a prefill of `prefill_tokens`, the tokens each layer
    moves to CG' and its predicted time then."""

    rates: tuple[SliceRates, ...]
    layer_time_s: tuple[float, ...]
    num_tokens: int
    mlp_bytes: int  # one layer's MLP weights as stored
    resident_bytes: int  # every layer's GG part
    buffer_bytes: int  # where CG and CG' slices land; 0 when every MLP is resident
    fixed_bytes: int  # embeddings, head, norms and every layer's attention weights
    budget_bytes: int | None
    prefill_tokens: int | None = None
    moved_tokens: tuple[int, ...] = ()
    prefill_time_s: tuple[float, ...] = ()

    @property
    def accelerator_weight_bytes(self) -> int:
        return self.fixed_bytes + self.resident_bytes + self.buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rates": [[r.cc, r.cg, r.gg] for r in self.rates], "layer_time_s": list(self.layer_time_s),
                "num_tokens": self.num_tokens, "mlp_bytes": self.mlp_bytes, "resident_bytes": self.resident_bytes,
                "buffer_bytes": self.buffer_bytes, "fixed_bytes": self.fixed_bytes,
                "accelerator_weight_bytes": self.accelerator_weight_bytes, "budget_bytes": self.budget_bytes,
                "prefill_tokens": self.prefill_tokens, "moved_tokens": list(self.moved_tokens),
                "prefill_time_s": list(self.prefill_time_s)}


def fixed_weight_bytes(shape: ModelShape, fmt: WeightFormat) -> int:
    """What slicing leaves resident: embeddings, head and norms, and each layer's QKV (with its
    bias) and O projections."""
    attention = sum(sum(fmt.linear_tensor_bytes(*linear_shapes(shape)[name])) for name in ("qkv", "o_proj"))
    if shape.attention_bias:
        attention += linear_shapes(shape)["qkv"][0] * fmt.dtype_bytes
    return resident_global_bytes(shape, fmt.dtype_bytes) + shape.num_layers * attention


def layer_work(shape: ModelShape, fmt: WeightFormat, num_tokens: int) -> MlpWork:
    """A decoder layer's MLP at a token count (every layer alike: ModelShape has no MoE fields yet;
    a MoE layer's is slicing_model.moe_mlp_work)."""
    return dense_mlp_work(shape.hidden_size, shape.intermediate_size, num_tokens, fmt)


def plan_slicing(shape: ModelShape, fmt: WeightFormat, costs: SlicingCosts, accelerator_weight_bytes: int | None,
                 num_tokens: int, fixed_rates: SliceRates | None = None, prefill_tokens: int | None = None,
                 gg_rates: Sequence[float] = DEFAULT_GG_RATES) -> SlicingPlan:
    """Every layer's rates for decode batches of `num_tokens` within `accelerator_weight_bytes`
    (None: unbounded), solved, or `fixed_rates` everywhere; PlacementError when they cannot fit."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens} must be >= 1")
    works = [layer_work(shape, fmt, num_tokens)] * shape.num_layers
    fixed = fixed_weight_bytes(shape, fmt)
    mlp_bytes = works[0].weight_bytes
    budget = accelerator_weight_bytes
    if fixed_rates is not None:
        rates = [fixed_rates] * shape.num_layers
    else:
        rates = _solve_rates(works, costs, fixed, budget, gg_rates)
    plan = _plan_of(works, costs, rates, fixed, budget)
    if budget is not None and plan.accelerator_weight_bytes > budget:
        raise PlacementError(f"MLP slicing needs {_gib(plan.accelerator_weight_bytes)} of accelerator memory for "
                             f"weights (attention, embeddings, head and norms {_gib(fixed)}, resident MLP parts "
                             f"{_gib(plan.resident_bytes)}, a buffer of one MLP {_gib(mlp_bytes)}) but "
                             f"--weights-gpu-gib gives {_gib(budget)}; give more, or lower GG in --mlp-slicing")
    if prefill_tokens is None:
        return plan
    prefill_work = layer_work(shape, fmt, prefill_tokens)
    prefill = [solve_moved_tokens(prefill_work, costs, layer_rates) for layer_rates in rates]
    return dataclasses.replace(plan, prefill_tokens=prefill_tokens, moved_tokens=tuple(moved for moved, _ in prefill),
                               prefill_time_s=tuple(time_s for _, time_s in prefill))


def _solve_rates(works: list[MlpWork], costs: SlicingCosts, fixed: int, budget: int | None,
                 gg_rates: Sequence[float]) -> list[SliceRates]:
    """Unbounded: each layer's fastest candidate. Else the faster of the greedy's rates within what
    the budget leaves beside one MLP's buffer, and every MLP resident (which needs no buffer), of
    those that fit."""
    solved: dict[MlpWork, LayerChoices] = {}
    choices = [solved.setdefault(work, layer_choices(work, costs, gg_rates)) for work in works]
    if budget is None:
        return [layer.solved[_fastest(layer)].rates for layer in choices]
    fitting = []
    if fixed + sum(work.weight_bytes for work in works) <= budget:
        fitting.append([SliceRates.resident()] * len(works))
    gg_budget = budget - fixed - max(work.weight_bytes for work in works)
    if gg_budget >= sum(layer.resident_bytes[0] for layer in choices):
        fitting.append([layer.solved[index].rates for layer, index in zip(choices, assign_gg(choices, gg_budget))])
    if not fitting:
        raise PlacementError(f"MLP slicing needs attention, embeddings, head and norms ({_gib(fixed)}) and a "
                             f"buffer of one MLP ({_gib(works[0].weight_bytes)}) on the accelerator, but "
                             f"--weights-gpu-gib gives {_gib(budget)}; give more")
    return min(fitting, key=lambda rates: _total_s(works, costs, rates))


def _fastest(layer: LayerChoices) -> int:
    return min(range(len(layer.solved)), key=lambda i: (layer.solved[i].time_s, i))


def _total_s(works: list[MlpWork], costs: SlicingCosts, rates: list[SliceRates]) -> float:
    return sum(layer_time_s(work, costs, layer_rates) for work, layer_rates in zip(works, rates))


def _plan_of(works: list[MlpWork], costs: SlicingCosts, rates: list[SliceRates], fixed: int,
             budget: int | None) -> SlicingPlan:
    resident = sum(round(r.gg * work.weight_bytes) for work, r in zip(works, rates))
    streams = any(r.gg < 1.0 for r in rates)
    return SlicingPlan(tuple(rates), tuple(layer_time_s(work, costs, r) for work, r in zip(works, rates)),
                       works[0].num_tokens, works[0].weight_bytes, resident,
                       max(work.weight_bytes for work in works) if streams else 0, fixed, budget)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB_BYTES:.2f} GiB"


def describe_slicing(plan: SlicingPlan) -> str:
    """The rates and predicted MLP times, runs of equal layers on one line, as `tandem plan` prints."""
    lines = [f"MLP slicing (ScheInfer): decode batch {plan.num_tokens}; per layer the MLP's CC (CPU) / CG "
             f"(streamed) / GG (resident) rates and its predicted time",
             f"  accelerator weights {_gib(plan.accelerator_weight_bytes)}: attention, embeddings, head and norms "
             f"{_gib(plan.fixed_bytes)}, resident MLP parts {_gib(plan.resident_bytes)}, CG buffer "
             f"{_gib(plan.buffer_bytes)}" + (f" (budget {_gib(plan.budget_bytes)})" if plan.budget_bytes else "")]
    start = 0
    for end in range(1, len(plan.rates) + 1):
        if end == len(plan.rates) or plan.rates[end] != plan.rates[start]:
            r = plan.rates[start]
            layers = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
            line = f"  {layers:<14} CC {r.cc:.3f}  CG {r.cg:.3f}  GG {r.gg:.3f}  {plan.layer_time_s[start] * 1e3:.3f} ms"
            if plan.prefill_tokens:
                line += (f"; prefill of {plan.prefill_tokens}: {plan.moved_tokens[start]} tokens on CG', "
                         f"{plan.prefill_time_s[start] * 1e3:.2f} ms")
            lines.append(line)
            start = end
    lines.append(f"  MLPs of one decode step: {sum(plan.layer_time_s) * 1e3:.2f} ms predicted")
    return "\n".join(lines)
