"""Mixture-of-experts decoder layers (Mixtral, Qwen2-MoE, Qwen3-MoE) on the Llama stages.

`MoeModel` is `LlamaModel` with two things swapped: a layer's MLP is a `FeedForward`, either a
dense `SwiGluMlp` or a `SparseMoe` (router, routed experts, optional shared expert), and Qwen3's
Q and K heads are RMS-normalized before RoPE. The stages (`pre_proj`, `attention`, `post_proj`,
...) are Llama's own, so Neo's pipeline and the runner drive it unchanged.

Every expert is a SwiGLU MLP of weight objects (engine/quant), one per expert, so the format
(dense, INT4) and the place (resident, streamed, CPU-computed) are chosen per expert. A batch's
tokens are grouped by expert (one stable sort of the (token, slot) pairs): each chosen expert's
weights are applied once per forward to all the rows routed to it, never per token.

Where a layer's parts live is the layer store's choice: a `MoeLayerStore` builds MoE layers.
`ResidentMoeLayers` keeps every layer resident; `PlannedLayers` (engine/offload/layer_store.py,
engine/offload/slicing/moe_slicing.py) puts whole experts in ScheInfer's CC, CG and GG tiers and
refuses a plan that streams a MoE layer whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from engine.model_config import ConfigError, ModelConfig
from engine.model.feed_forward import FeedForward, SiluMul, SwiGluMlp
from engine.model.layers import rms_norm
from engine.model.feed_forward import Make
from engine.model.llama import LlamaModel
from engine.model.layer_weights import attention_weights, linear_maker
from engine.model.layer_store import LayerStore
from engine.model.registry import register_model
from engine.quant import LinearMethod, LinearWeight, create_linear_method
from engine.weights import WeightLoader
from engine.weights.base import ROUTER_KEY, SHARED_EXPERT_GATE_KEY, SHARED_EXPERT_PREFIX, expert_prefix

@dataclass
class Routing:
    """Each token's chosen experts and the weights their outputs are summed with."""

    expert_ids: torch.Tensor  # [num_tokens, top_k] int64
    weights: torch.Tensor  # [num_tokens, top_k] fp32


class TopKRouter:
    """softmax(gate(x)) over the experts, the top k kept; renormalized to sum to one where the
    family does it (Mixtral always, the Qwen families by `norm_topk_prob`)."""

    def __init__(self, gate: LinearWeight, top_k: int, normalize: bool) -> None:
        self.gate = gate  # [num_experts, hidden]
        self.top_k = top_k
        self.normalize = normalize

    def route(self, x: torch.Tensor) -> Routing:
        probs = torch.softmax(self.gate.apply(x).float(), dim=-1)  # [num_tokens, num_experts]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(expert_ids, weights)


@dataclass
class ExpertGroups:
    """A batch's (token, slot) pairs sorted by expert: expert e's pairs are the `counts[e]` rows
    after the first sum(counts[:e])."""

    token_rows: torch.Tensor  # [num_tokens * top_k] int64, the token of each sorted pair
    weights: torch.Tensor  # [num_tokens * top_k] fp32, its routing weight
    counts: list[int]  # [num_experts] pairs routed to each expert

    def spans(self):
        """(expert, the slice of its pairs) for each expert with pairs, in expert order."""
        start = 0
        for expert, count in enumerate(self.counts):
            if count:
                yield expert, slice(start, start + count)
            start += count


def group_by_expert(routing: Routing, num_experts: int) -> ExpertGroups:
    """One stable sort groups the pairs by expert, tokens in order within each group."""
    flat_ids = routing.expert_ids.flatten()  # [num_tokens * top_k], token-major
    order = torch.argsort(flat_ids, stable=True)
    top_k = routing.expert_ids.shape[1]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    return ExpertGroups(order // top_k, routing.weights.flatten()[order], counts)


class SharedExpert:
    """An MLP every token passes through beside the routed experts; Qwen2-MoE scales its output
    by sigmoid(gate(x)) first."""

    def __init__(self, mlp: SwiGluMlp, gate: LinearWeight | None) -> None:
        self.mlp = mlp
        self.gate = gate  # [1, hidden] or None

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        out = self.mlp.apply(x, silu_mul)
        return out if self.gate is None else torch.sigmoid(self.gate.apply(x)) * out

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        return self.mlp.linear_weights() + (() if self.gate is None else (self.gate,))


class SparseMoe:
    """Routed experts: each token's output is the routing-weighted sum of its top-k experts'
    (plus the shared expert's, where there is one)."""

    def __init__(self, router: TopKRouter, experts: list[SwiGluMlp], shared: SharedExpert | None = None) -> None:
        self.router = router
        self.experts = experts
        self.shared = shared

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        groups = group_by_expert(self.router.route(x), len(self.experts))
        out = torch.zeros_like(x)  # [num_tokens, hidden]
        if groups.token_rows.numel():
            # One gather, each expert's matmuls on its run of rows, one weighted scatter-add: on the
            # CPU a small torch op between two experts' kernel calls costs more than a decode
            # row's GEMV, so nothing else runs per expert.
            rows = x[groups.token_rows]  # [num_pairs, hidden], grouped by expert
            expert_out = torch.cat([self.experts[expert].apply(rows[pairs], silu_mul)
                                    for expert, pairs in groups.spans()])
            # pairs in expert order: each token's outputs are summed in expert order, as HF's loop does
            out.index_add_(0, groups.token_rows, (expert_out * groups.weights[:, None]).to(x.dtype))
        if self.shared is not None:
            out = out + self.shared.apply(x, silu_mul)
        return out

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        shared = () if self.shared is None else self.shared.linear_weights()
        experts = tuple(w for expert in self.experts for w in expert.linear_weights())
        return (self.router.gate, *experts, *shared)


@dataclass
class MoeLayerWeights:
    """A decoder layer of a MoE family: Llama's attention weights, Qwen3's per-head Q/K norms,
    and a FeedForward (routed experts, or a dense MLP in the layers the config keeps dense)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: LinearWeight  # [q_size + 2 * kv_size, hidden]
    o_proj: LinearWeight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    mlp: SwiGluMlp | SparseMoe
    # Qwen3: RMSNorm weights shared by every Q head and by every K head
    q_norm: torch.Tensor | None = None  # [head_dim]
    k_norm: torch.Tensor | None = None  # [head_dim]

    @classmethod
    def from_loaded(cls, w: dict, index: int, config: ModelConfig, make: Make, device: torch.device,
                    dtype: torch.dtype) -> "MoeLayerWeights":
        head_norms = {key: w[key].to(device) for key in ("q_norm", "k_norm")} if config.qk_norm else {}
        return cls(**attention_weights(w, make, device), mlp=_feed_forward(w, index, config, make, device, dtype),
                   **head_norms)

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        return (self.qkv, self.o_proj, *self.mlp.linear_weights())

    def dense_tensors(self) -> tuple[torch.Tensor, ...]:
        head_norms = () if self.q_norm is None else (self.q_norm, self.k_norm)
        return (self.input_norm, self.post_norm, *head_norms)


def _feed_forward(w: dict, index: int, config: ModelConfig, make: Make, device: torch.device,
                  dtype: torch.dtype) -> SwiGluMlp | SparseMoe:
    moe = config.moe
    if moe is None or not moe.is_moe_layer(index):
        return SwiGluMlp.from_loaded(w, make)
    router, shared = router_and_shared(w, config, make, dtype, device)
    experts = [SwiGluMlp.from_loaded(w, make, expert_prefix(e)) for e in range(moe.num_experts)]
    return SparseMoe(router, experts, shared)


def router_and_shared(w: dict, config: ModelConfig, make: Make, dtype: torch.dtype,
                      device: torch.device) -> tuple[TopKRouter, SharedExpert | None]:
    """A routed layer's router and shared expert (where the family has one), on `device`. The
    router and the shared expert's gate stay dense whatever the experts' format: they are tiny,
    and a rounding there changes which experts a token gets."""
    moe = config.moe
    make_dense = linear_maker(create_linear_method("dense"), dtype, device)
    router = TopKRouter(make_dense(w[ROUTER_KEY]), moe.num_experts_per_token, moe.normalize_top_k)
    shared = None
    if moe.has_shared_expert:
        gate = make_dense(w[SHARED_EXPERT_GATE_KEY]) if moe.shared_expert_gated else None
        shared = SharedExpert(SwiGluMlp.from_loaded(w, make, SHARED_EXPERT_PREFIX), gate)
    return router, shared


@runtime_checkable
class MoeLayerStore(Protocol):
    """A LayerStore that holds mixture-of-experts layers: it builds each, placing its parts."""

    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        """Layer `index` of a MoE family (a routed or a dense one) from what the loader gave."""


class ResidentMoeLayers(LayerStore):
    """Every layer of a MoE model resident on the GPU."""

    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        make = linear_maker(linear, dtype, self.device)
        return MoeLayerWeights.from_loaded(loaded, index, config, make, self.device, dtype)


@register_model("mixtral")
@register_model("qwen2_moe")
@register_model("qwen3_moe")
class MoeModel(LlamaModel):
    """LlamaModel whose layers are MoeLayerWeights, built by a MoeLayerStore: resident without a
    store, or with experts sliced across tiers (engine/offload/slicing/moe_slicing.py)."""

    graph_capturable = False  # routing groups rows by expert counts read on the host

    def __init__(self, config: ModelConfig, loader: WeightLoader, dtype: torch.dtype, device: torch.device | str, *args,
                 layer_store: LayerStore | None = None, **kwargs) -> None:
        layer_store = layer_store or ResidentMoeLayers(torch.device(device))
        if not isinstance(layer_store, MoeLayerStore):
            raise ConfigError(f"{config.architecture}: {type(layer_store).__name__} does not hold mixture-of-experts "
                              "layers (weight streaming moves whole dense layers); serve it with every layer "
                              "resident, or with its experts sliced (--mlp-slicing)")
        super().__init__(config, loader, dtype, device, *args, layer_store=layer_store, **kwargs)

    def _build_layer(self, index: int, loaded: dict) -> MoeLayerWeights:
        return self.layer_store.build_moe_layer(index, loaded, self.config, self.linear_method, self.dtype)

    def _normalize_heads(self, layer: int, qk: torch.Tensor) -> torch.Tensor:
        w, cfg = self.layers[layer], self.config
        if w.q_norm is None:
            return qk
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)  # each head over its head_dim
        return torch.cat([rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)], dim=1)

