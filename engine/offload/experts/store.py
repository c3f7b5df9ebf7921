"""The layer store of a MoE model under the hot-expert cache: every layer's attention, router, shared
expert (and the dense layers' MLPs) resident on the GPU; every routed expert in host memory, where
the CPU computes it, with each layer's hottest experts also in GPU slots (engine/runtime/
expert_cache.py) and a forward's big misses fetched (engine/offload/experts/hot_moe.py).

The experts' host bytes: where the GPU is a host thread (device cpu, the testbed) it computes
from the CPU's format, so each expert is one host image the CPU's weights are views into and
copies leave from; elsewhere (CUDA: its own layouts, pinned copies) a second host image in the
GPU's format is kept beside the CPU's weights.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.device.cores import CoreAssignment
from engine.offload.cpu_side import HOST, CpuSide, HostWeight
from engine.offload.experts.cache import ExpertCache, ExpertFetch, LayerExperts, split_buffer
from engine.offload.experts.hot_moe import HotExpertMoe
from engine.offload.ring import BUFFER_FORMAT
from engine.offload.stats import WeightStats
from engine.offload.transfer import CopyEngine, create_copy_engine
from engine.model_config import ModelConfig
from engine.model.feed_forward import SwiGluMlp
from engine.model.layer_weights import attention_weights, linear_maker
from engine.model.layer_store import LayerStore
from engine.model.moe import MoeLayerWeights, router_and_shared
from engine.quant import LinearMethod, LinearWeight
from engine.weights.base import expert_prefix
from engine.weights.layer_image import LayerImage, meta_templates
from scheduler.planning.experts.split import ExpertShape, SplitModel
from scheduler.planning.experts.hot_experts import ExpertCachePlan
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.tiers import Tier

logger = logging.getLogger(__name__)

HOT_EXPERTS_FORMAT = "hot expert slots"  # weight_bytes' format label for the slots
EXPERT_STATS_KIND = "experts"  # the saved windows, beside the cost tables: <digest>.experts.json


class HotExpertLayers(LayerStore):
    """A MoeLayerStore: routed layers over one ExpertCache, everything else resident."""

    weights_stay_put = False  # a slot's bytes change as experts come and go

    def __init__(self, plan: ExpertCachePlan, device: torch.device, copy_engine: CopyEngine, cpu: CpuSide,
                 stats: WeightStats, split_costs: SlicingCosts | None = None, stats_path: Path | None = None) -> None:
        super().__init__(device)
        self.plan = plan
        self.copy_engine = copy_engine
        self.cpu = cpu
        self.stats = stats
        self.shares_host_bytes = torch.device(device).type == HOST.type
        self.cache = ExpertCache(copy_engine, stats, plan.num_slots, plan.window_tokens, plan.num_experts_per_token)
        self.split_costs = split_costs
        self.split_model: SplitModel | None = None
        self.fetch: ExpertFetch | None = None
        self.stats_path = stats_path

    # ---- building ---------------------------------------------------------------------------
    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        make = linear_maker(linear, dtype, self.device)
        head_norms = {key: loaded[key].to(self.device) for key in ("q_norm", "k_norm")} if config.qk_norm else {}
        if not config.moe.is_moe_layer(index):
            return MoeLayerWeights.from_loaded(loaded, index, config, make, self.device, dtype)
        router, shared = router_and_shared(loaded, config, make, dtype, self.device)
        self._add_experts(index, loaded, config.moe.num_experts, linear, dtype)
        if self.split_model is None and self.split_costs is not None:
            self.split_model = self._create_split_model(config)
            if self.plan.num_fetch_buffers:
                self.fetch = ExpertFetch(self.copy_engine, self.plan.num_fetch_buffers, self.stats)
        mlp = HotExpertMoe(index, router, self.cache, shared, self.cpu, self.stats, self.fetch, self.split_model,
                           times_gpu=self.shares_host_bytes)
        return MoeLayerWeights(**attention_weights(loaded, make, self.device), mlp=mlp, **head_norms)

    def _add_experts(self, index: int, loaded: dict, num_experts: int, linear: LinearMethod,
                     dtype: torch.dtype) -> LayerExperts:
        """Each expert's host image (one buffer for the layer's experts: one huge-page-aligned
        allocation, not one per expert) and CPU weights, added to the cache as layer `index`."""
        for_cpu = linear_maker(linear, dtype, HOST, HOST)
        for_gpu = linear_maker(linear, dtype, HOST, self.device)  # built on the host, copied over
        cpu_weights = [_expert_linears(loaded, for_cpu, expert) for expert in range(num_experts)]
        copied = cpu_weights if self.shares_host_bytes else [_expert_linears(loaded, for_gpu, expert)
                                                             for expert in range(num_experts)]
        layout, templates = LayerImage.of(copied[0]), meta_templates(copied[0])
        block = self.copy_engine.allocate_host(layout.nbytes * num_experts)
        images = split_buffer(block, layout.nbytes, num_experts)
        for weights, image in zip(copied, images):
            layout.write(weights, image)
        if self.shares_host_bytes:  # the CPU computes from the very bytes copies leave from
            cpu_weights = [layout.bind(templates, image) for image in images]
        cpu_mlps = [SwiGluMlp(*(HostWeight(self.cpu.own_threads(weights[name])) for name in ("gate_up", "down")))
                    for weights in cpu_weights]
        return self.cache.add_layer(index, layout, templates, images, cpu_mlps)

    def _create_split_model(self, config: ModelConfig) -> SplitModel:
        image = self.cache.image
        gate_up = sum(t.nbytes for t in image.tensors if t.weight == "gate_up")
        shape = ExpertShape(config.hidden_size, config.moe.expert_intermediate_size, gate_up,
                            image.nbytes - gate_up, image.nbytes)
        return SplitModel(self.split_costs, shape)

    # ---- serving ------------------------------------------------------------------------------
    def use_gpu(self, gpu) -> None:
        self.cpu.queue = gpu
        self.cache.queue = gpu

    def start(self) -> None:
        """Slots filled (from the previous run's statistics where saved), fetch buffers allocated."""
        saved = ExpertCache.load(self.stats_path) if self.stats_path is not None else None
        self.cache.start(saved)
        if self.fetch is not None:
            self.fetch.start(self.cache.image, self.cache.templates)
        logger.info("hot experts: %d of %d per routed layer on the GPU (%.2f GiB), first chosen %s; %d fetch "
                    "buffers", self.plan.num_slots, self.plan.num_experts, self.cache.slot_bytes / 2**30,
                    "from the previous run's statistics" if saved else "in index order",
                    0 if self.fetch is None else self.fetch.num_buffers)

    def begin_serving(self) -> None:
        self.cache.recording = True

    def between_forwards(self) -> None:
        self.cache.between_forwards()

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        extra = {(HOT_EXPERTS_FORMAT, Tier.GPU): self.cache.slot_bytes,
                 (BUFFER_FORMAT, Tier.GPU): 0 if self.fetch is None else self.fetch.buffer_bytes}
        if not self.shares_host_bytes:
            extra[("expert host copies", Tier.HOST)] = sum(data.numel() for entry in self.cache.layers.values()
                                                            for data in entry.images)
        return {key: nbytes for key, nbytes in extra.items() if nbytes}

    def close(self) -> None:
        if self.stats_path is not None and self.cache.layers:
            try:
                self.cache.save(self.stats_path)
            except OSError as exc:
                logger.warning("expert statistics not saved to %s: %s", self.stats_path, exc)
        self.cache.close()
        if self.fetch is not None:
            self.fetch.close()
        self.copy_engine.close()


def _expert_linears(loaded: dict, make, expert: int) -> dict[str, LinearWeight]:
    mlp = SwiGluMlp.from_loaded(loaded, make, expert_prefix(expert))
    return {"gate_up": mlp.gate_up, "down": mlp.down}


def create_expert_store(plan: ExpertCachePlan, device: torch.device, cores: CoreAssignment, stats: WeightStats,
                        split_costs: SlicingCosts | None = None, stats_path: Path | None = None) -> HotExpertLayers:
    """The store on `device`: copies by the transfer threads on the host-side cores, the CPU's
    experts on the CPU side's threads (the caller's own on device cpu)."""
    engine = create_copy_engine(device, cores.copy_threads, cores.cpu_attention_cores or None)
    cpu = CpuSide(None if cores.device == "cpu" else cores.cpu_attention_threads)
    return HotExpertLayers(plan, torch.device(device), engine, cpu, stats, split_costs, stats_path)
