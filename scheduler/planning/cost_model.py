"""Cost models: how long the parts of one iteration take, so the scheduler can plan (Neo 3.2).

Times are seconds. Per-layer quantities (`linear`, the attentions) are for ONE transformer
layer; the scheduler multiplies by `num_layers`. Neo's symbols:

    T_l   = linear(tokens)                       pre-projection + post-projection + MLP
    T_ga  = prefill_attention(...) + gpu_decode_attention(...)
    T_ca  = cpu_decode_attention(...)
    T_cl  = cpu_linear(tokens)                   the CPU's own share of T_l (sliced MLPs), beside T_ca

Two implementations sit behind `CostModel`: `TableCostModel` interpolates tables profiled on this
machine (engine/profiler.py builds them), and `RooflineCostModel` (scheduler/simulation/roofline.py) derives
the same quantities from a hardware profile, for the simulator. No torch here.
"""
from __future__ import annotations

import bisect
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence


class CostModel(ABC):
    num_layers: int

    @abstractmethod
    def linear(self, num_tokens: int) -> float:
        """One layer's token-wise work (norms, QKV, RoPE, O-proj, MLP) for `num_tokens` tokens."""

    def linear_again(self, num_tokens: int) -> float:
        """A second pass over a layer whose weights are already on the GPU (Neo's batch-1
        right after batch-0): the same as `linear` unless weights stream in (the streamed layer's
        transfer is paid by the first pass)."""
        return self.linear(num_tokens)

    def cpu_linear(self, num_tokens: int) -> float:
        """The part of `linear(num_tokens)` the host CPU computes itself (ScheInfer's CC slices of
        the MLP) while the GPU computes the rest: the stage lasts `linear`, and the CPU is
        busy for this long of it, on the same time line as its decode attention. None by default."""
        return 0.0

    @abstractmethod
    def prefill_attention(self, seq_lens: Sequence[int]) -> float:
        """One layer's causal attention over these prefill sequences, on the GPU."""

    @abstractmethod
    def gpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        """One layer's decode attention on the GPU; `context_tokens` summed over sequences."""

    @abstractmethod
    def cpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        """One layer's decode attention on the host CPU; `context_tokens` summed over sequences."""

    @abstractmethod
    def head(self, num_seqs: int) -> float:
        """Per iteration, outside the layers: embedding, final norm and LM head for `num_seqs` rows."""

    @abstractmethod
    def swap(self, num_blocks: int) -> float:
        """Moving `num_blocks` KV blocks (all layers, K and V) between the two pools."""

    def handoff(self) -> float:
        """What a CPU attention stage adds to its layer beyond the attention itself: its Q/K/V
        reaching the CPU and its output reaching the GPU's next stage (on the testbed two
        thread wake-ups, on CUDA two event waits and small copies). Paid once per non-empty CPU
        stage per layer. 0 unless measured."""
        return 0.0


# ---- interpolation ------------------------------------------------------------------------
class TableError(ValueError):
    """A cost table that cannot be used (empty, unsorted, negative times)."""


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the end segments, clamped at 0."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear y(x) through measured points; beyond the ends it follows the nearest
    segment's slope (so costs keep growing past the profiled grid), never below zero."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.xs or len(self.xs) != len(self.ys):
            raise TableError("a cost curve needs one or more (x, y) points")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise TableError(f"cost curve x values must be strictly increasing, got {self.xs}")
        if any(y < 0 for y in self.ys):
            raise TableError("cost curve times must be >= 0")

    @classmethod
    def from_points(cls, points: Sequence[Sequence[float]]) -> "Curve":
        pts = sorted((float(x), float(y)) for x, y in points)
        return cls(tuple(p[0] for p in pts), tuple(p[1] for p in pts))

    def __call__(self, x: float) -> float:
        return _interpolate(self.xs, self.ys, x)

    def to_points(self) -> list[list[float]]:
        return [[x, y] for x, y in zip(self.xs, self.ys)]


@dataclass(frozen=True)
class Grid:
    """Bilinear z(x, y) over a rectangular grid (`zs[i][j]` at `xs[i]`, `ys[j]`), extrapolating
    linearly beyond the edges like `Curve`."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    zs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if len(self.zs) != len(self.xs) or any(len(row) != len(self.ys) for row in self.zs):
            raise TableError("a cost grid needs one value per (x, y) pair")
        for axis in (self.xs, self.ys):
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
                raise TableError(f"cost grid axes must be non-empty and strictly increasing, got {axis}")
        if any(z < 0 for row in self.zs for z in row):
            raise TableError("cost grid times must be >= 0")
        # the scheduler calls this per CPU-sequence per iteration: build the row curves once
        object.__setattr__(self, "_rows", tuple(Curve(self.ys, row) for row in self.zs))

    def __call__(self, x: float, y: float) -> float:
        # interpolate along y in each row, then along x through those values
        return _interpolate(self.xs, [row(y) for row in self._rows], x)

    def to_dict(self) -> dict[str, Any]:
        return {"xs": list(self.xs), "ys": list(self.ys), "zs": [list(r) for r in self.zs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Grid":
        return cls(tuple(map(float, d["xs"])), tuple(map(float, d["ys"])),
                   tuple(tuple(map(float, r)) for r in d["zs"]))


# ---- profiled tables ------------------------------------------------------------------------
@dataclass(frozen=True)
class TableCostModel(CostModel):
    """Interpolates per-layer times measured on this machine.

    linear:        tokens -> s                 (one layer)
    prefill_attn:  prompt length -> s          (one sequence, one layer; summed over sequences)
    gpu_decode:    total context tokens -> s   (one layer)
    cpu_decode:    (batch, total context tokens) -> s, bilinear (one layer)
    head:          rows -> s                   (per iteration)
    swap_per_block: s per block moved between pools
    handoff_seconds: s per CPU stage per layer (see CostModel.handoff)
    """

    num_layers: int
    linear_curve: Curve
    prefill_curve: Curve
    gpu_decode_curve: Curve
    cpu_decode_grid: Grid
    head_curve: Curve
    swap_per_block: float = 0.0
    handoff_seconds: float = 0.0

    def linear(self, num_tokens: int) -> float:
        return self.linear_curve(num_tokens) if num_tokens > 0 else 0.0

    def prefill_attention(self, seq_lens: Sequence[int]) -> float:
        return sum(self.prefill_curve(n) for n in seq_lens)

    def gpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        return self.gpu_decode_curve(context_tokens) if num_seqs > 0 else 0.0

    def cpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        return self.cpu_decode_grid(num_seqs, context_tokens) if num_seqs > 0 else 0.0

    def head(self, num_seqs: int) -> float:
        return self.head_curve(num_seqs) if num_seqs > 0 else 0.0

    def swap(self, num_blocks: int) -> float:
        return self.swap_per_block * num_blocks

    def handoff(self) -> float:
        return self.handoff_seconds

    # ---- files ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "linear": self.linear_curve.to_points(),
            "prefill_attention": self.prefill_curve.to_points(),
            "gpu_decode_attention": self.gpu_decode_curve.to_points(),
            "cpu_decode_attention": self.cpu_decode_grid.to_dict(),
            "head": self.head_curve.to_points(),
            "swap_per_block": self.swap_per_block,
            "handoff": self.handoff_seconds,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TableCostModel":
        try:
            return cls(
                num_layers=int(d["num_layers"]),
                linear_curve=Curve.from_points(d["linear"]),
                prefill_curve=Curve.from_points(d["prefill_attention"]),
                gpu_decode_curve=Curve.from_points(d["gpu_decode_attention"]),
                cpu_decode_grid=Grid.from_dict(d["cpu_decode_attention"]),
                head_curve=Curve.from_points(d["head"]),
                swap_per_block=float(d.get("swap_per_block", 0.0)),
                handoff_seconds=float(d.get("handoff", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise TableError(f"malformed cost tables: {exc!r}") from exc

    @classmethod
    def load(cls, path: str | Path) -> "TableCostModel":
        return cls.from_dict(json.loads(Path(path).read_text()))


# ---- model shapes (for the roofline model and the simulator) --------------------------------
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: float) -> int:
    """Bytes of K and V of one token across `num_layers` layers, `element_bytes` per element (a
    KVFormat's, scales included: scheduler/planning/kv_format.py): the one formula the engine's pools, the
    profiler's scratch pools and the roofline model size by."""
    return round(2 * num_layers * num_kv_heads * head_dim * element_bytes)


@dataclass(frozen=True)
class ModelShape:
    """The numbers a cost model needs about a Llama-family model. The engine builds it from its
    parsed model config (`engine.model.ModelConfig.shape`), so HF configs are read in one place."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix (stored once)
    attention_bias: bool = False  # Q, K and V carry a bias (Qwen2)
    # Mixture of experts (num_experts 0: a dense model): each layer's MLP is a router over
    # `num_experts` SwiGLU experts of width `expert_intermediate_size`, `num_experts_per_token` of
    # them used by each token, plus a shared expert every token uses where the width is not 0.
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # A MoE model's layers whose MLP is dense, of width `intermediate_size` (Qwen-MoE's
    # `mlp_only_layers`). The slicing planner reads it; the per-layer aggregates below (and the
    # streaming planner, which does not take MoE) count every layer as a MoE layer.
    dense_mlp_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_mlp_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params(self) -> int:
        """Weights of one layer's QKV and O projections."""
        return self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size

    def _mlp_params(self, num_experts: int) -> int:
        """A layer's MLP weights with `num_experts` routed experts counted (the router and the
        shared expert and its gate always)."""
        hidden = self.hidden_size
        if not self.is_moe:
            return 3 * hidden * self.intermediate_size
        shared = 3 * hidden * self.shared_expert_intermediate_size
        shared_gate = hidden if self.shared_expert_intermediate_size else 0
        router = self.num_experts * hidden
        return router + num_experts * 3 * hidden * self.expert_intermediate_size + shared + shared_gate

    @property
    def layer_params(self) -> int:
        """Weights in one layer's linear work (QKV, O, gate/up, down; every expert of a MoE layer):
        what the layer stores."""
        return self.attention_params + self._mlp_params(self.num_experts)

    @property
    def active_layer_params(self) -> int:
        """Weights one token's linear work in a layer multiplies by: a MoE layer's router, its
        top-k experts and shared expert (the whole layer of a dense model)."""
        return self.attention_params + self._mlp_params(self.num_experts_per_token)

    def kv_bytes_per_token_layer(self, element_bytes: float) -> int:
        """K and V of one token in one layer."""
        return kv_bytes_per_token(1, self.num_kv_heads, self.head_dim, element_bytes)
