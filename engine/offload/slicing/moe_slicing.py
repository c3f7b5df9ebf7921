"""ScheInfer's slicing at expert granularity: a mixture-of-experts layer's routed experts split
whole between the CPU (CC), host memory streamed to the GPU (CG) and the GPU (GG).

A layer's `SliceRates` give `rates.counts(num_experts)` experts to each part, in expert order:
experts [0, cc) are CC's (their weights in host memory, computed by the CPU where they are
stored), [cc, cc + cg) CG's (one streamed image of all their gate/up and down weights, loaded
through the ring every forward like a dense MLP's CG slice), the rest GG's,
resident with the attention, the router, Qwen2's shared-expert gate and the shared expert (which
every token uses, so it stays where it computes fastest). The layers a MoE config keeps dense
are sliced along their units by engine/offload/slicing/sliced_mlp.py as any dense MLP.

Execution (`SlicedSparseMoe.apply`) keeps the resident layer's grouped routing and ScheInfer's
one hop each way. The GPU routes and sorts the (token, slot) pairs by expert; CC's
experts come first, so their pairs are a prefix of the sorted ones. Their rows, token indices and
routing weights hop to the host once, the CPU runs each CC expert once over its rows and sums
their weighted outputs per token ([num_tokens, hidden]), which hops back once; meanwhile the
GPU computes its experts (CG, GG) and the shared expert. The output is CC's sum, then the
GPU's pairs added in expert order, then the shared expert: each token's expert outputs
are added in expert order exactly as the resident `SparseMoe` adds them, whichever side finished
first. A forward whose tokens route nothing to CC's experts makes no hop.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

import torch

from engine.offload.cpu_side import HOST, CpuSide, HostWeight
from engine.offload.slicing.moved_part import host_image
from engine.device.queues import Future
from engine.offload.stats import WeightStats
from engine.model_config import ModelConfig
from engine.model.feed_forward import Make, SiluMul, SwiGluMlp
from engine.model.layer_weights import attention_linears, linear_maker
from engine.model.moe import ExpertGroups, SharedExpert, SparseMoe, TopKRouter, group_by_expert
from engine.quant import LinearMethod, LinearWeight, create_linear_method
from engine.weights.base import ROUTER_KEY, SHARED_EXPERT_GATE_KEY, SHARED_EXPERT_PREFIX, expert_prefix
from scheduler.planning.slicing.rates import SliceKind, SliceRates
from scheduler.planning.tiers import Tier


class LayerPlacer(Protocol):
    """What building a sliced layer needs of the store it goes into (engine/offload/layer_store.py)."""

    device: torch.device
    cpu: CpuSide
    stats: WeightStats

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A host buffer for an image copies leave from."""

    def place_resident(self, image, templates: dict[str, LinearWeight], data: torch.Tensor) -> dict[str, LinearWeight]:
        """Weights copied from their host image into GPU memory of their own."""

    def place_streamed(self, index: int, tier: Tier, image, templates: dict[str, LinearWeight],
                       data: torch.Tensor) -> dict[str, LinearWeight]:
        """Weights streamed through the ring from `tier` each time the layer is acquired."""


class SlicedSparseMoe(SparseMoe):
    """A SparseMoe whose experts [0, cc) the CPU computes from host memory while the GPU
    computes the others (CG's from the layer's streamed image, GG's resident)."""

    def __init__(self, layer: int, router: TopKRouter, experts: list[SwiGluMlp], shared: SharedExpert | None,
                 counts: tuple[int, int, int], cpu: CpuSide, stats: WeightStats) -> None:
        super().__init__(router, experts, shared)
        self.layer = layer
        self.counts = dict(zip(SliceKind, counts))  # experts of each slice
        self.num_cc = counts[0]
        self.cpu = cpu
        self.stats = stats

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        groups = group_by_expert(self.router.route(x), len(self.experts))
        rows = x[groups.token_rows]  # [num_pairs, hidden], grouped by expert
        spans = list(groups.spans())
        cc_spans = [span for span in spans if span[0] < self.num_cc]
        num_cc_pairs = sum(groups.counts[:self.num_cc])  # CC's experts come first: their pairs lead
        cc = self._start_cc(rows, groups, num_cc_pairs, cc_spans, x.shape[0], silu_mul)
        gpu = [self.experts[expert].apply(rows[pairs], silu_mul) for expert, pairs in spans[len(cc_spans):]]
        shared = None if self.shared is None else self.shared.apply(x, silu_mul)
        out = torch.zeros_like(x) if cc is None else cc.result().to(x.device, non_blocking=True)  # [num_tokens, hidden]
        if gpu:
            weights = groups.weights[num_cc_pairs:, None]
            out.index_add_(0, groups.token_rows[num_cc_pairs:], (torch.cat(gpu) * weights).to(x.dtype))
        return out if shared is None else out + shared

    def _start_cc(self, rows: torch.Tensor, groups: ExpertGroups, num_pairs: int, spans: list[tuple[int, slice]],
                  num_tokens: int, silu_mul: SiluMul) -> Future | None:
        """Hand the CPU the first `num_pairs` pairs, CC's experts' (`spans`): their rows, tokens
        and routing weights hop to the host; the future's value is their weighted sum per token."""
        if not num_pairs:
            return None
        queue = self.cpu.queue
        hops = [queue.copy_to_host(t[:num_pairs]) for t in (rows, groups.token_rows, groups.weights)]
        return queue.run_on_host(lambda: self._compute_cc(hops, spans, num_tokens, silu_mul))

    def _compute_cc(self, hops: list[Future], spans: list[tuple[int, slice]], num_tokens: int,
                    silu_mul: SiluMul) -> torch.Tensor:
        start = time.perf_counter()
        rows, token_rows, weights = (hop.result() for hop in hops)  # [num_pairs, hidden], [num_pairs] twice
        with self.cpu.threads():
            expert_out = torch.cat([self.experts[expert].apply(rows[pairs], silu_mul) for expert, pairs in spans])
            out = rows.new_zeros(num_tokens, rows.shape[1])  # [num_tokens, hidden]
            out.index_add_(0, token_rows, (expert_out * weights[:, None]).to(rows.dtype))
        self.stats.num_cc_calls += 1
        self.stats.cc_s += time.perf_counter() - start
        self.stats.cc_thread_ids.add(threading.get_ident())
        return out


# ---- building a layer ---------------------------------------------------------------------------
def _mlp_linears(loaded: dict, make: Make, prefix: str) -> dict[str, LinearWeight]:
    """The MLP under `prefix` as its fused gate/up and down weights, named `<prefix>gate_up` / `<prefix>down`."""
    mlp = SwiGluMlp.from_loaded(loaded, make, prefix)
    return {f"{prefix}gate_up": mlp.gate_up, f"{prefix}down": mlp.down}


def _mlp(weights: dict[str, LinearWeight], prefix: str) -> SwiGluMlp:
    return SwiGluMlp(weights[f"{prefix}gate_up"], weights[f"{prefix}down"])


def place_routed_layer(store: LayerPlacer, index: int, loaded: dict, config: ModelConfig, rates: SliceRates,
                       linear: LinearMethod, dtype: torch.dtype) -> dict:
    """A routed layer's weights in their tiers, its experts split whole at `rates`: the resident
    ones one image copied to the GPU, CG's experts one image streamed from host memory,
    CC's on the host. -> qkv, o_proj and the SlicedSparseMoe"""
    moe = config.moe
    counts = rates.counts(moe.num_experts)
    parts = _routed_linears(loaded, config, counts, linear, dtype, store)
    allocate = store.allocate_host
    weights = {**parts[SliceKind.CC], **store.place_resident(*host_image(parts[SliceKind.GG], allocate))}
    if parts[SliceKind.CG]:
        weights.update(store.place_streamed(index, Tier.HOST, *host_image(parts[SliceKind.CG], allocate)))
    router = TopKRouter(weights[ROUTER_KEY], moe.num_experts_per_token, moe.normalize_top_k)
    shared = None
    if moe.has_shared_expert:
        shared = SharedExpert(_mlp(weights, SHARED_EXPERT_PREFIX), weights.get(SHARED_EXPERT_GATE_KEY))
    experts = [_mlp(weights, expert_prefix(e)) for e in range(moe.num_experts)]
    mlp = SlicedSparseMoe(index, router, experts, shared, counts, store.cpu, store.stats)
    return dict(qkv=weights["qkv"], o_proj=weights["o_proj"], mlp=mlp)


def _routed_linears(loaded: dict, config: ModelConfig, counts: tuple[int, int, int], linear: LinearMethod,
                    dtype: torch.dtype, store: LayerPlacer) -> dict[SliceKind, dict[str, LinearWeight]]:
    """A routed layer's weight objects by slice: CC the CPU's experts (laid out for it), CG
    the streamed experts, GG the resident weights (attention, router, shared expert and
    experts), the last two laid out for the GPU."""
    moe = config.moe
    for_gpu = linear_maker(linear, dtype, HOST, store.device)  # built on the host, copied over
    for_cpu = linear_maker(linear, dtype, HOST, HOST)
    # the router and the shared expert's gate stay dense, as in the resident layer (engine/model/moe.py)
    dense_for_gpu = linear_maker(create_linear_method("dense"), dtype, HOST, store.device)
    parts = {SliceKind.CC: {}, SliceKind.CG: {}, SliceKind.GG: attention_linears(loaded, for_gpu)}
    parts[SliceKind.GG][ROUTER_KEY] = dense_for_gpu(loaded[ROUTER_KEY])
    if moe.has_shared_expert:
        parts[SliceKind.GG].update(_mlp_linears(loaded, for_gpu, SHARED_EXPERT_PREFIX))
        if moe.shared_expert_gated:
            parts[SliceKind.GG][SHARED_EXPERT_GATE_KEY] = dense_for_gpu(loaded[SHARED_EXPERT_GATE_KEY])
    slice_of_expert = [kind for kind, num_experts in zip(SliceKind, counts) for _ in range(num_experts)]
    for expert, slice_name in enumerate(slice_of_expert):
        if slice_name == SliceKind.CC:
            parts[SliceKind.CC].update({name: HostWeight(store.cpu.own_threads(w))
                                for name, w in _mlp_linears(loaded, for_cpu, expert_prefix(expert)).items()})
        else:
            parts[slice_name].update(_mlp_linears(loaded, for_gpu, expert_prefix(expert)))
    return parts
