"""A routed layer over the hot-expert cache (engine/execution/expert_cache.py): the GPU computes the
experts resident in the layer's slots, the CPU the ones the batch misses, and a big batch may
fetch some misses onto the GPU instead (`ExpertFetch`).

One forward: the GPU routes and groups the (token, slot) pairs by expert and counts them into the
layer's window; the missed experts' rows, gathered, hop to the host once, the CPU runs each over
its rows and the unweighted outputs hop back once; meanwhile the GPU computes its resident
experts, then the fetched ones as their copies land, then the shared expert. Every expert's
output is placed back in expert order and the weighted pairs are summed by one index_add, as the
resident `SparseMoe` sums them, so the result is the same bit for bit whichever experts were where.
"""
from __future__ import annotations

import threading
import time

import torch

from engine.execution.cpu_side import CpuSide
from engine.execution.expert_cache import ExpertCache, ExpertFetch, LayerExperts
from engine.execution.queues import Future
from engine.execution.stats import WeightStats
from engine.model.feed_forward import SiluMul
from engine.model.moe import SharedExpert, SparseMoe, TopKRouter, group_by_expert
from scheduler.placement.expert_split import ExpertSplit, SplitModel

Span = tuple[int, slice]  # an expert and its run of the grouped pairs
NO_SPLIT = ExpertSplit([], [])  # hot experts on the GPU, the misses on the CPU


class HotExpertMoe(SparseMoe):
    """A SparseMoe whose experts compute where the layer's slot table says, as above."""

    def __init__(self, layer: int, router: TopKRouter, cache: ExpertCache, shared: SharedExpert | None,
                 cpu: CpuSide, stats: WeightStats, fetch: ExpertFetch | None = None,
                 split_model: SplitModel | None = None, times_gpu: bool = False) -> None:
        """`split_model`: where a forward's experts compute (None: hot ones on the GPU, the rest on
        the CPU); `times_gpu`: the GPU's work runs synchronously on its thread (device cpu, the
        testbed), so its wall time calibrates the model's GPU side too."""
        self.cached: LayerExperts = cache.layers[layer]
        super().__init__(router, self.cached.cpu_mlps, shared)
        self.layer = layer
        self.cache = cache
        self.cpu = cpu
        self.stats = stats
        self.fetch = fetch
        self.split_model = split_model
        self.times_gpu = times_gpu and split_model is not None

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        groups = group_by_expert(self.router.route(x), len(self.experts))
        if self.cache.recording:
            self.cached.window.add(groups.counts)
        out = torch.zeros_like(x)  # [num_tokens, hidden]
        if groups.token_rows.numel():
            rows = x[groups.token_rows]  # [num_pairs, hidden], grouped by expert
            spans = list(groups.spans())
            outputs = self._expert_outputs(rows, spans, silu_mul)
            expert_out = torch.cat([outputs[expert] for expert, _ in spans])
            out.index_add_(0, groups.token_rows, (expert_out * groups.weights[:, None]).to(x.dtype))
        return out if self.shared is None else out + self.shared.apply(x, silu_mul)

    def _expert_outputs(self, rows: torch.Tensor, spans: list[Span], silu_mul: SiluMul) -> dict[int, torch.Tensor]:
        slot_of = self.cached.slot_of  # as it stands for this forward: it changes only between forwards
        hits = [span for span in spans if span[0] in slot_of]
        misses = [span for span in spans if span[0] not in slot_of]
        split = self._split(hits, misses)
        fetched = [misses[i][0] for i in split.fetched]
        on_gpu = [span for i, span in enumerate(hits) if i not in split.hits_on_cpu]
        on_cpu = [span for span in spans if span[0] not in fetched and span not in on_gpu]  # expert order
        cpu = self._start_cpu(rows, on_cpu, silu_mul)
        loads = self.fetch.load([self.cached.images[e] for e in fetched]) if fetched else []
        slot_mlps = self.cached.slot_mlps
        start = time.perf_counter()
        outputs = {e: slot_mlps[slot_of[e]].apply(rows[pairs], silu_mul) for e, pairs in on_gpu}
        if self.times_gpu and on_gpu:
            self.split_model.observe("gpu", [s.stop - s.start for _, s in on_gpu], time.perf_counter() - start)
        spans_of = dict(spans)
        for index, (expert, copy) in enumerate(zip(fetched, loads)):
            outputs[expert] = self.fetch.mlp(index, copy).apply(rows[spans_of[expert]], silu_mul)
            self.fetch.done(index)
        if cpu is not None:
            back = cpu.result().to(rows.device, non_blocking=True)
            outputs.update(zip((e for e, _ in on_cpu), back.split([s.stop - s.start for _, s in on_cpu])))
        self._count(hits, misses, split)
        return outputs

    def _split(self, hits: list[Span], misses: list[Span]) -> ExpertSplit:
        if self.split_model is None:
            return NO_SPLIT
        max_fetches = 0 if self.fetch is None else self.fetch.num_buffers
        return self.split_model.split([s.stop - s.start for _, s in hits], [s.stop - s.start for _, s in misses],
                                      max_fetches)

    def _start_cpu(self, rows: torch.Tensor, spans: list[Span], silu_mul: SiluMul) -> Future | None:
        """Hand the CPU its experts' rows (gathered: one hop); the future's value is their outputs,
        unweighted, in the order of `spans`."""
        if not spans:
            return None
        index = torch.cat([torch.arange(s.start, s.stop) for _, s in spans]).to(rows.device)
        hop = self.cpu.queue.copy_to_host(rows[index])
        sizes = [s.stop - s.start for _, s in spans]
        return self.cpu.queue.run_on_host(lambda: self._compute_on_cpu(hop, [e for e, _ in spans], sizes, silu_mul))

    def _compute_on_cpu(self, hop: Future, experts: list[int], sizes: list[int], silu_mul: SiluMul) -> torch.Tensor:
        start = time.perf_counter()
        rows = hop.result()  # [num_cpu_pairs, hidden]
        compute_start = time.perf_counter()
        with self.cpu.threads():
            out = torch.cat([self.experts[e].apply(part, silu_mul) for e, part in zip(experts, rows.split(sizes))])
        if self.split_model is not None:
            self.split_model.observe("cpu", sizes, time.perf_counter() - compute_start)
        self.stats.num_cc_calls += 1
        self.stats.cc_s += time.perf_counter() - start
        self.stats.cc_thread_ids.add(threading.get_ident())
        return out

    def _count(self, hits: list[Span], misses: list[Span], split: ExpertSplit) -> None:
        stats = self.stats
        stats.num_hit_pairs += sum(s.stop - s.start for _, s in hits)
        stats.num_miss_pairs += sum(s.stop - s.start for _, s in misses)
        stats.num_fetched_pairs += sum(misses[i][1].stop - misses[i][1].start for i in split.fetched)
        stats.num_hit_pairs_on_cpu += sum(hits[i][1].stop - hits[i][1].start for i in split.hits_on_cpu)
