"""The layer store a `ModelPlan` describes (scheduler/planning/layer_plan.py), composed of parts:

- a `BufferRing` with its transfer thread (engine/offload/ring.py), through which whole
  streamed layers (PIPO) and sliced MLPs' CG parts (ScheInfer) alike pass;
- a `CpuSide` (engine/offload/cpu_side.py) on which CC parts run;
- `SlicedMlp`s (engine/offload/slicing/sliced_mlp.py) and `SlicedSparseMoe`s (engine/runtime/
  moe_slicing.py), each one layer's MLP with one `apply`;
- optionally a `MovedPart` (engine/offload/slicing/moved_part.py): CG' for a prefill's moved tokens.

Every layer becomes an image built on the host: a resident one is copied into a GPU
buffer of its own (so resident and streamed layers compute from the same kind of memory), a
streamed one stays in host memory or goes to its file, a sliced one keeps its attention and GG
resident, CC on the host and CG in the ring. What the parts did goes to one `WeightStats`.
"""
from __future__ import annotations

import logging

import torch

from engine.device.cores import CoreAssignment
from engine.offload.cpu_side import HOST, CpuSide
from engine.offload.slicing.moe_slicing import SlicedSparseMoe, place_routed_layer
from engine.offload.slicing.moved_part import MovedPart, host_image
from engine.offload.ring import BUFFER_FORMAT, BufferRing
from engine.offload.slicing.sliced_mlp import MLP_NAMES, SlicedMlp, slice_mlp, unit_alignment
from engine.offload.stats import WeightStats
from engine.offload.transfer import CopyEngine, create_copy_engine, pin_to
from engine.model_config import ConfigError, ModelConfig
from engine.model.layer_weights import LayerWeights, attention_linears, linear_maker
from engine.model.layer_store import LayerStore
from engine.model.moe import MoeLayerWeights
from engine.quant import LinearMethod, LinearWeight
from engine.offload.convert import build_host_layer
from engine.weights.direct_io import DirectReader
from engine.weights.layer_files import ConversionKey, LayerFiles
from engine.weights.layer_image import LayerImage, meta_templates
from scheduler.planning.layer_plan import LayerPlan, ModelPlan
from scheduler.planning.slicing.moved_tokens import MovedTokens
from scheduler.planning.slicing.rates import NUM_CG_BUFFERS, SliceKind, SliceRates
from scheduler.planning.tiers import Tier

logger = logging.getLogger(__name__)


def ring_buffers(plan: ModelPlan) -> int:
    """The ring's buffers: as the planner sized the ring; for a plan composed without it, as many
    as the placement's pipeline holds for whole layers, and NUM_CG_BUFFERS where MLPs are sliced
    (the larger)."""
    if plan.num_ring_buffers:
        return plan.num_ring_buffers
    num_buffers = plan.placement.num_buffers if plan.placement is not None else 0
    return max(num_buffers, NUM_CG_BUFFERS) if plan.rates is not None else num_buffers


class PlannedLayers(LayerStore):
    """Decoder layers placed as `plan` says; also a MoeLayerStore (routed layers split by whole experts)."""

    weights_stay_put = False  # streamed weights are rebound to ring buffers as they come

    def __init__(self, plan: ModelPlan, device: torch.device, copy_engine: CopyEngine, ring: BufferRing,
                 cpu: CpuSide, stats: WeightStats, moved: MovedPart | None = None,
                 gpu_weight_budget_bytes: int | None = None, global_weight_bytes: int = 0) -> None:
        super().__init__(device)
        self.plan = plan
        self.layers = list(plan.layers)  # a resident layer may fall back to streaming when it does not fit
        self.copy_engine = copy_engine
        self.ring = ring
        self.cpu = cpu
        self.stats = stats
        self.moved = moved
        self.budget_bytes = gpu_weight_budget_bytes
        self.used_bytes = global_weight_bytes  # embeddings, LM head, norms: resident always
        self.mlps: dict[int, SlicedMlp] = {}  # the sliced dense MLPs
        self.moe_layers: dict[int, SlicedSparseMoe] = {}  # the routed layers with experts off the GPU

    @property
    def tiers(self) -> list[Tier]:
        return [layer.tier for layer in self.layers]

    # ---- building ---------------------------------------------------------------------------
    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        layer = self.layers[index]
        if layer.sliced:
            return self._build_sliced(index, layer.rates, loaded, linear, dtype)
        built = build_host_layer(None, index, linear, dtype, self.device, self.copy_engine.allocate_host, loaded)
        host, image = built.weights, built.image
        templates = meta_templates(host.named_linears())
        norms = (host.input_norm.to(self.device), host.post_norm.to(self.device))
        if not layer.streamed:
            if self._fits(image.nbytes):
                return LayerWeights.of_linears(*norms, self.place_resident(image, templates, built.data))
            logger.info("layer %d: %.1f MiB more than the planner counted leave no room on the GPU; "
                        "streamed from host memory instead", index, image.nbytes / 2**20)
            self.layers[index] = LayerPlan(Tier.HOST)
        return LayerWeights.of_linears(*norms, self.place_streamed(index, self.layers[index].tier, image, templates,
                                                                   built.data))

    def _build_sliced(self, index: int, rates: SliceRates, loaded: dict, linear: LinearMethod,
                      dtype: torch.dtype) -> LayerWeights:
        """Attention and GG resident (one image), CC on the host, CG one streamed image."""
        counts = rates.counts(loaded["gate_proj"].shape[0], unit_alignment(linear))
        cut = slice_mlp(loaded, counts)
        for_gpu = linear_maker(linear, dtype, HOST, self.device)  # built on the host, copied over
        resident = attention_linears(loaded, for_gpu)
        resident.update({f"gg.{name}": for_gpu(w) for name, w in cut.get(SliceKind.GG, {}).items()})
        weights = self.place_resident(*host_image(resident, self.allocate_host))
        slices = {}
        if SliceKind.CC in cut:
            slices[SliceKind.CC] = self._cc_weights(index, cut[SliceKind.CC], linear, dtype)
        if SliceKind.CG in cut:
            streamed = {name: for_gpu(w) for name, w in cut[SliceKind.CG].items()}
            slices[SliceKind.CG] = self.place_streamed(index, Tier.HOST, *host_image(streamed, self.allocate_host))
        if SliceKind.GG in cut:
            slices[SliceKind.GG] = {name: weights[f"gg.{name}"] for name in MLP_NAMES}
        mlp = self.mlps[index] = SlicedMlp(index, slices, counts, self.cpu, self.stats, self.moved)
        return LayerWeights(input_norm=loaded["input_layernorm"].to(self.device), qkv=weights["qkv"],
                            o_proj=weights["o_proj"], post_norm=loaded["post_attention_layernorm"].to(self.device),
                            mlp=mlp)

    def _cc_weights(self, index: int, cut: dict, linear: LinearMethod, dtype: torch.dtype) -> dict[str, LinearWeight]:
        """CC's weights for the CPU, on its threads; with CG' on, their image kept for its copies."""
        on_host = {name: linear_maker(linear, dtype, HOST, HOST)(w) for name, w in cut.items()}
        if self.moved is not None:
            for_gpu = linear_maker(linear, dtype, HOST, self.device)
            on_host = self.moved.host_weights(index, on_host, lambda: {name: for_gpu(w)
                                                                       for name, w in cut.items()})
        return {name: self.cpu.own_threads(w) for name, w in on_host.items()}

    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        """Layer `index` of a MoE model: a routed layer with its experts split whole at the
        layer's rates, a dense layer as `build` places it."""
        layer = self.layers[index]
        if layer.streamed:
            raise ConfigError(f"{config.architecture}: layer {index} is placed for whole-layer streaming, which does "
                              "not take mixture-of-experts layers; slice its experts instead (--mlp-slicing)")
        head_norms = {key: loaded[key].to(self.device) for key in ("q_norm", "k_norm")} if config.qk_norm else {}
        if not config.moe.is_moe_layer(index):
            dense = self.build(index, loaded, linear, dtype)
            return MoeLayerWeights(dense.input_norm, dense.qkv, dense.o_proj, dense.post_norm, dense.mlp, **head_norms)
        placed = place_routed_layer(self, index, loaded, config, layer.rates or SliceRates.resident(), linear, dtype)
        if layer.sliced:
            self.moe_layers[index] = placed["mlp"]
        return MoeLayerWeights(input_norm=loaded["input_layernorm"].to(self.device),
                               post_norm=loaded["post_attention_layernorm"].to(self.device), **placed, **head_norms)

    # ---- placing (moe_slicing.LayerPlacer) ---------------------------------------------------------
    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return self.copy_engine.allocate_host(nbytes)

    def place_resident(self, image: LayerImage, templates: dict[str, LinearWeight],
                       data: torch.Tensor) -> dict[str, LinearWeight]:
        """Weights copied from their host image into a GPU buffer of their own, bound there."""
        self.used_bytes += image.nbytes
        buffer = self.copy_engine.allocate_buffer(image.nbytes)
        self.copy_engine.copy(buffer, data)
        return image.bind(templates, buffer)

    def place_streamed(self, index: int, tier: Tier, image: LayerImage, templates: dict[str, LinearWeight],
                       data: torch.Tensor) -> dict[str, LinearWeight]:
        return self.ring.add(index, tier, image, templates, data)

    def _fits(self, nbytes: int) -> bool:
        if self.budget_bytes is None:
            return True
        placement = self.plan.placement
        reserved = self.plan.ring_bytes or self.ring.num_buffers * (placement.layer_bytes if placement else 0)
        return self.used_bytes + nbytes + reserved <= self.budget_bytes

    # ---- serving ------------------------------------------------------------------------------
    def use_gpu(self, gpu) -> None:
        self.cpu.queue = gpu

    def start(self) -> None:
        """The ring for the largest streamed item, then CG''s buffer where the weight budget has
        room for it beside the ring (the planner keeps room for it); where it has not, every
        token's CC stays on the CPU, as logged."""
        self.copy_engine.synchronize()  # resident layers' copies
        self.stats.slices = any(layer.sliced for layer in self.layers)
        total = self.used_bytes + self.ring.planned_bytes()
        if self.budget_bytes is not None and total > self.budget_bytes:
            raise ConfigError(f"weights on the GPU take {total / 2**30:.2f} GiB ({self.ring.num_buffers} "
                              f"layer buffers included), more than --weights-gpu-gib gives "
                              f"({self.budget_bytes / 2**30:.2f} GiB); give more")
        self.ring.start()
        self.used_bytes += self.ring.allocated_bytes
        if self.moved is not None:
            self._start_moving()

    def _start_moving(self) -> None:
        room_bytes = None if self.budget_bytes is None else self.budget_bytes - self.used_bytes
        if room_bytes is not None and self.moved.largest_image_bytes > room_bytes:
            logger.warning("prefill token assignment off: CG''s buffer of %.1f MiB does not fit in --weights-gpu-gib "
                           "beside the other weights and buffers (%.1f MiB left); the CPU computes CC for every token",
                           self.moved.largest_image_bytes / 2**20, room_bytes / 2**20)
            self._stop_moving()
            return
        self.moved.start()
        self.used_bytes += self.moved.buffer_bytes

    def _stop_moving(self) -> None:
        self.moved.close()
        self.moved = None
        for mlp in self.mlps.values():
            mlp.moved = None

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        totals = {(BUFFER_FORMAT, Tier.GPU): self.ring.allocated_bytes}
        for key, nbytes in (self.moved.extra_weight_bytes() if self.moved is not None else {}).items():
            totals[key] = totals.get(key, 0) + nbytes
        return {key: nbytes for key, nbytes in totals.items() if nbytes}

    def acquire(self, layer: int) -> None:
        self.ring.acquire(layer)

    def release(self, layer: int) -> None:
        self.ring.release(layer)

    def recover(self) -> None:
        self.ring.recover()

    def close(self) -> None:
        if self.moved is not None:
            self.moved.close()
        self.ring.close()
        self.copy_engine.close()


def create_layer_store(plan: ModelPlan, device: torch.device, cores: CoreAssignment, files: LayerFiles | None = None,
                       num_io_threads: int = 1, gpu_weight_budget_bytes: int | None = None,
                       global_weight_bytes: int = 0, moved_tokens: MovedTokens | None = None,
                       stats: WeightStats | None = None) -> PlannedLayers:
    """The store for `plan` on `device`: transfer threads on the host-side cores (all of them
    where the GPU has none of its own), disk reads `num_io_threads` at a time, CC on the
    CPU side's threads (the caller's own on device cpu, where one pool serves both sides), CG'
    for the tokens `moved_tokens` names (None: the CPU computes CC for every token)."""
    stats = stats if stats is not None else WeightStats()
    engine, reader = create_transfer(plan, device, cores, num_io_threads)
    ring = BufferRing(engine, ring_buffers(plan), stats, files, reader)
    cpu = CpuSide(None if cores.device == "cpu" else cores.cpu_attention_threads)
    moved = None
    if moved_tokens is not None and plan.rates is not None:
        moved = MovedPart(moved_tokens, engine, torch.device(device).type == HOST.type, stats)
    return PlannedLayers(plan, device, engine, ring, cpu, stats, moved, gpu_weight_budget_bytes,
                         global_weight_bytes)


def open_layer_files(plan: ModelPlan, directory: str, key: ConversionKey, num_layers: int) -> LayerFiles:
    """The offload directory's files for `plan`'s disk-placed layers, checked before any weight
    loads (serve writes a damaged one again from the source as its layer is built), and the space
    for those to write checked with the planner's layer bytes (WeightLoadError where it is short)."""
    files = LayerFiles(directory, key, num_layers)
    disk_layers = [index for index, layer in enumerate(plan.layers) if layer.tier == Tier.DISK]
    to_write = files.check_space(disk_layers, plan.placement.layer_bytes)
    logger.info("offload directory %s: %d of %d disk-placed layers' files to write", files.directory, len(to_write),
                len(disk_layers))
    return files


def create_transfer(plan: ModelPlan, device: torch.device, cores: CoreAssignment,
                    num_io_threads: int) -> tuple[CopyEngine, DirectReader | None]:
    """The copy engine and (with disk-placed layers) the disk reader a store streams with:
    `cores.copy_threads` transfer threads on the host-side cores (all of them where the GPU has
    none of its own), disk reads `num_io_threads` at a time."""
    host_cores = cores.cpu_attention_cores or None
    engine = create_copy_engine(device, cores.copy_threads, host_cores)
    reader = None
    if plan.num_layers_in(Tier.DISK):
        reader = DirectReader(num_io_threads, initializer=pin_to(host_cores))
    return engine, reader
