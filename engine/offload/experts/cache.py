"""The hot-expert cache: each routed layer keeps its most popular experts in GPU slots, chosen from
measured routing (scheduler/planning/experts/hot_experts.py), while every expert stays in host memory,
where the CPU computes the ones a forward misses (engine/offload/experts/hot_moe.py).

Changes never stall a forward. Between forwards (`between_forwards`, on the engine thread, the
GPU idle) the cache installs the promotions whose copies have landed, then asks the policy what
the windows call for: a demotion only drops the expert from the slot table (no copy: its weights
are on the host already), a promotion takes a free slot and queues the copy of the expert's host
image into it on a background transfer thread; the expert computes on the CPU until its copy is
installed. A forward reads the slot table as it stood when it started.

`ExpertFetch` is the other way onto the GPU: the experts a big batch misses, copied into a few
buffers for that forward where the split model (scheduler/planning/experts/split.py) says the
copy pays.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future as CopyFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.offload.stats import WeightStats
from engine.offload.transfer import CopyEngine, pin_to
from engine.model.feed_forward import SwiGluMlp
from engine.quant import LinearWeight
from engine.weights.layer_image import LayerImage
from scheduler.planning.experts.hot_experts import ExpertWindow, choose_changes, coldest_first, rank_experts

logger = logging.getLogger(__name__)

def bind_expert(image: LayerImage, templates: dict[str, LinearWeight], buffer: torch.Tensor) -> SwiGluMlp:
    weights = image.bind(templates, buffer)
    return SwiGluMlp(weights["gate_up"], weights["down"])


def split_buffer(buffer: torch.Tensor, nbytes: int, count: int) -> list[torch.Tensor]:
    """`count` consecutive views of `nbytes` each: one allocation, not one per expert (each
    huge-page-aligned allocation pads by up to a huge page)."""
    return [buffer[index * nbytes:(index + 1) * nbytes] for index in range(count)]


@dataclass
class LayerExperts:
    """One routed layer's experts in host memory: each one's image (what a copy moves, in the GPU's
    format) and the CPU's weights for it."""

    images: list[torch.Tensor]  # uint8 [image.nbytes] per expert
    cpu_mlps: list[SwiGluMlp]
    window: ExpertWindow
    # ---- the slots (filled by ExpertCache.start) ------------------------------------------------
    slot_mlps: list[SwiGluMlp] = field(default_factory=list)  # each slot's weights, bound to its buffer
    slot_buffers: list[torch.Tensor] = field(default_factory=list)
    slot_states: list[dict] = field(default_factory=list)  # the copy engine's events per slot
    slot_of: dict[int, int] = field(default_factory=dict)  # resident expert -> slot: what a forward reads
    pending: dict[int, tuple[int, CopyFuture]] = field(default_factory=dict)  # expert -> (slot, its copy)

    @property
    def free_slots(self) -> list[int]:
        taken = set(self.slot_of.values()) | {slot for slot, _ in self.pending.values()}
        return [slot for slot in range(len(self.slot_buffers)) if slot not in taken]


@dataclass(frozen=True)
class LayerHeat:
    """One routed layer as the cache sees it now: what its window counted and which experts compute
    from a GPU slot (copies still in flight excluded)."""

    window_pairs: list[int]  # routed (token, expert) pairs per expert in the window
    hot: frozenset[int]  # experts in the layer's slots


class ExpertCache:
    """Every routed layer's slots, windows and background copies (one transfer thread)."""

    def __init__(self, copy_engine: CopyEngine, stats: WeightStats, num_slots: int, window_tokens: int,
                 num_experts_per_token: int) -> None:
        self.copy_engine = copy_engine
        self.stats = stats
        self.num_slots = num_slots
        self.window_tokens = window_tokens
        self.top_k = num_experts_per_token
        self.layers: dict[int, LayerExperts] = {}
        self.image: LayerImage | None = None  # every expert's layout (they share one shape and format)
        self.templates: dict[str, LinearWeight] = {}
        self.queue = None  # the GPU queue: ordering hooks run in the compute stream's context
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-expert-copy",
                                          initializer=pin_to(copy_engine.cores))
        self.frozen = False  # tests: no changes but the ones they force
        self.recording = False  # windows count traffic once serving begins, not the profiler's forwards

    def add_layer(self, layer: int, image: LayerImage, templates: dict[str, LinearWeight],
                  images: list[torch.Tensor], cpu_mlps: list[SwiGluMlp]) -> LayerExperts:
        if self.image is None:
            self.image, self.templates = image, templates
        elif image != self.image:
            raise ValueError(f"layer {layer}'s experts are laid out unlike layer {min(self.layers)}'s")
        window = ExpertWindow(len(images), self.top_k, self.window_tokens)
        entry = self.layers[layer] = LayerExperts(images, cpu_mlps, window)
        return entry

    # ---- start ----------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return 0 if self.image is None else self.image.nbytes * self.num_slots * len(self.layers)

    def start(self, saved: dict[int, list[int]] | None = None) -> None:
        """Allocate and bind every layer's slots and fill them: the hottest experts of the saved
        statistics where a layer has them (its window starts from them too), else experts in
        index order."""
        self.stats.experts = True
        for layer, entry in self.layers.items():
            entry.slot_buffers = split_buffer(self.copy_engine.allocate_buffer(self.image.nbytes * self.num_slots),
                                              self.image.nbytes, self.num_slots)
            entry.slot_mlps = [bind_expert(self.image, self.templates, buffer) for buffer in entry.slot_buffers]
            entry.slot_states = [{} for _ in range(self.num_slots)]
            counts = (saved or {}).get(layer)
            if counts is not None and len(counts) == len(entry.images):
                entry.window.seed(counts)
                initial = rank_experts(counts)[:self.num_slots]
            else:
                initial = list(range(self.num_slots))
            for slot, expert in enumerate(initial):
                self.copy_engine.copy(entry.slot_buffers[slot], entry.images[expert])
                entry.slot_of[expert] = slot
        self.copy_engine.synchronize()

    # ---- changes ----------------------------------------------------------------------------------
    def between_forwards(self) -> None:
        """Install landed copies, then queue what each layer's window asks for. Engine thread, GPU idle."""
        for layer, entry in self.layers.items():
            self._install_landed(entry)
            if self.frozen or not self.num_slots:
                continue
            counts = entry.window.counts
            for victim, candidate in choose_changes(counts, set(entry.slot_of), set(entry.pending), self.num_slots):
                if victim is not None:
                    self.demote(layer, victim)
                self.promote(layer, candidate)

    def promote(self, layer: int, expert: int) -> None:
        """Queue the copy of `expert` into a free slot of `layer` (the coldest resident expert is
        demoted first when none is free); it computes on the GPU once installed."""
        entry = self.layers[layer]
        if expert in entry.slot_of or expert in entry.pending or not self.num_slots:
            return
        if not entry.free_slots:
            self.demote(layer, coldest_first(entry.window.counts, entry.slot_of)[0])
        slot = entry.free_slots[0]
        entry.pending[expert] = (slot, self._thread.submit(self._copy, entry, slot, expert))

    def demote(self, layer: int, expert: int) -> None:
        """Drop `expert` from `layer`'s slots: the next forward computes it on the CPU. No copy."""
        entry = self.layers[layer]
        slot = entry.slot_of.pop(expert, None)
        if slot is None:
            return
        self._on_gpu(lambda: self.copy_engine.on_release(entry.slot_states[slot]))  # what computed from it is queued
        self.stats.num_expert_demotions += 1

    def _copy(self, entry: LayerExperts, slot: int, expert: int) -> None:
        self.copy_engine.load(entry.slot_buffers[slot], entry.images[expert], entry.slot_states[slot])

    def _install_landed(self, entry: LayerExperts) -> None:
        for expert, (slot, copy) in list(entry.pending.items()):
            if not copy.done():
                continue
            del entry.pending[expert]
            copy.result()  # a failed copy fails here, on the engine thread
            self._on_gpu(lambda: self.copy_engine.wait_loaded(entry.slot_states[slot]))
            entry.slot_of[expert] = slot
            self.stats.num_expert_promotions += 1
            self.stats.promoted_bytes += self.image.nbytes

    def settle(self) -> None:
        """Wait for every queued copy and install it (tests force changes with it)."""
        for entry in self.layers.values():
            for _, copy in list(entry.pending.values()):
                copy.result()
            self._install_landed(entry)

    def _on_gpu(self, fn) -> None:
        if self.queue is None:
            fn()
        else:
            self.queue.submit(fn).result()

    # ---- what it holds ----------------------------------------------------------------------------
    def heat(self) -> dict[int, LayerHeat]:
        """Every routed layer's window counts and hot set, copied: safe to call from another thread
        (the /metrics scrape). Each copy is one C-level call under the GIL, so it never sees a dict
        mid-resize; a window may show one forward's counts partly added."""
        return {layer: LayerHeat(entry.window.counts, frozenset(entry.slot_of))
                for layer, entry in self.layers.items()}

    def save(self, path: Path) -> None:
        """The windows, for the next run's first hot sets."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        windows = {str(layer): heat.window_pairs for layer, heat in self.heat().items()}
        tmp.write_text(json.dumps({"window_counts": windows}))
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> dict[int, list[int]] | None:
        try:
            data = json.loads(path.read_text())
            return {int(layer): [int(c) for c in counts] for layer, counts in data["window_counts"].items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("expert statistics %s unreadable (%s); starting from experts in index order", path, exc)
            return None

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class ExpertFetch:
    """A few GPU buffers the experts a big batch misses are copied into for one layer's forward,
    when the fetch model says so; each copy on a transfer thread of its own, in order, the GPU
    computing each fetched expert once its copy has landed."""

    def __init__(self, copy_engine: CopyEngine, num_buffers: int, stats: WeightStats) -> None:
        self.copy_engine = copy_engine
        self.num_buffers = num_buffers
        self.stats = stats
        self.buffers: list[torch.Tensor] = []
        self.mlps: list[SwiGluMlp] = []
        self.states: list[dict] = []
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-expert-fetch",
                                          initializer=pin_to(copy_engine.cores))

    def start(self, image: LayerImage, templates: dict[str, LinearWeight]) -> None:
        self.buffers = split_buffer(self.copy_engine.allocate_buffer(image.nbytes * self.num_buffers), image.nbytes,
                                    self.num_buffers)
        self.mlps = [bind_expert(image, templates, buffer) for buffer in self.buffers]
        self.states = [{} for _ in self.buffers]

    @property
    def buffer_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)

    def load(self, images: list[torch.Tensor]) -> list[CopyFuture]:
        """Start copying these experts' images into buffers 0, 1, ... in order."""
        return [self._thread.submit(self._copy, index, image) for index, image in enumerate(images)]

    def _copy(self, index: int, image: torch.Tensor) -> None:
        self.copy_engine.load(self.buffers[index], image, self.states[index])
        self.stats.fetched_bytes += image.numel()
        self.stats.expert_copy_thread_ids.add(threading.get_ident())

    def mlp(self, index: int, copy: CopyFuture) -> SwiGluMlp:
        """Buffer `index`'s expert once its copy has landed."""
        copy.result()
        self.copy_engine.wait_loaded(self.states[index])
        return self.mlps[index]

    def done(self, index: int) -> None:
        """What computes from buffer `index` is queued: the next copy into it may follow."""
        self.copy_engine.on_release(self.states[index])

    def close(self) -> None:
        self._thread.shutdown(wait=True)
