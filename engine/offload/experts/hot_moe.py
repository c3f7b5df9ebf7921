"""A routed layer over the hot-expert cache (engine/offload/experts/cache.py): the GPU computes the
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

from engine.offload.cpu_side import CpuSide
from engine.offload.experts.cache import ExpertCache, ExpertFetch, LayerExperts
from engine.device.queues import Future
from engine.offload.stats import WeightStats
from engine.model.feed_forward import SiluMul, SwiGluMlp
from engine.model.moe import ExpertGroups, SharedExpert, SparseMoe, TopKRouter, group_by_expert
from scheduler.planning.experts.split import ExpertSplit, SplitModel

Span = tuple[int, slice]  # an expert and its run of the grouped pairs
NO_SPLIT = ExpertSplit([], [])  # hot experts on the GPU, the misses on the CPU
# From this many routed pairs (a prefill's) each side weights its experts' outputs and each is
# summed as is, and the CPU gathers its own rows: concatenating, weighting and summing every pair's
# output on the GPU's time line after the CPU's cost more than the experts saved there.
PIECEWISE_MIN_PAIRS = 512


class Pairs:
    """A forward's routed pairs as the experts read them: `source` rows indexed by `index` (the
    tokens x and each pair's token; or the pairs' rows already gathered and their positions), and
    whether outputs come back weighted by the pairs' routing weights, in x's dtype."""

    def __init__(self, source: torch.Tensor, groups: ExpertGroups, weighted: bool) -> None:
        self.source = source  # [num_tokens, hidden] (weighted) or [num_pairs, hidden]
        self.groups = groups
        self.weighted = weighted
        self.device = source.device

    def rows(self, span: slice) -> torch.Tensor:
        return self.source[self.groups.token_rows[span]] if self.weighted else self.source[span]

    def output(self, mlp: SwiGluMlp, span: slice, silu_mul: SiluMul) -> torch.Tensor:
        out = mlp.apply(self.rows(span), silu_mul)
        return (out * self.groups.weights[span, None]).to(self.source.dtype) if self.weighted else out

    def for_cpu(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """What the CPU needs for the pairs at `positions`: the source, its rows' index into it, and
        (weighted) their routing weights."""
        if not self.weighted:
            return [self.source, positions]
        return [self.source, self.groups.token_rows[positions], self.groups.weights[positions]]


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
        num_pairs = groups.token_rows.numel()
        if num_pairs >= PIECEWISE_MIN_PAIRS:  # each expert's weighted output summed as is: no concatenation
            spans = list(groups.spans())
            outputs = self._expert_outputs(Pairs(x, groups, weighted=True), spans, silu_mul)
            for expert, pairs in spans:  # expert order, as one index_add over them all would add them
                out.index_add_(0, groups.token_rows[pairs], outputs[expert])
        elif num_pairs:
            spans = list(groups.spans())
            outputs = self._expert_outputs(Pairs(x[groups.token_rows], groups, weighted=False), spans, silu_mul)
            expert_out = torch.cat([outputs[expert] for expert, _ in spans])
            out.index_add_(0, groups.token_rows, (expert_out * groups.weights[:, None]).to(x.dtype))
        return out if self.shared is None else out + self.shared.apply(x, silu_mul)

    def _expert_outputs(self, pairs: "Pairs", spans: list[Span], silu_mul: SiluMul) -> dict[int, torch.Tensor]:
        """Each routed expert's output over its pairs (weighted where `pairs.weighted`), computed
        where the split puts it: the GPU's first, then the fetched ones, the CPU's meanwhile."""
        slot_of = self.cached.slot_of  # as it stands for this forward: it changes only between forwards
        hits = [span for span in spans if span[0] in slot_of]
        misses = [span for span in spans if span[0] not in slot_of]
        split = self._split(hits, misses)
        fetched = [misses[i][0] for i in split.fetched]
        on_gpu = [span for i, span in enumerate(hits) if i not in split.hits_on_cpu]
        on_cpu = [span for span in spans if span[0] not in fetched and span not in on_gpu]  # expert order
        cpu = self._start_cpu(pairs, on_cpu, silu_mul)
        loads = self.fetch.load([self.cached.images[e] for e in fetched]) if fetched else []
        slot_mlps = self.cached.slot_mlps
        start = time.perf_counter()
        outputs = {e: pairs.output(slot_mlps[slot_of[e]], span, silu_mul) for e, span in on_gpu}
        if self.times_gpu and on_gpu:
            elapsed_s = time.perf_counter() - start
            self.split_model.observe("gpu", [s.stop - s.start for _, s in on_gpu], elapsed_s)
            self.stats.gpu_expert_s += elapsed_s
        spans_of = dict(spans)
        for index, (expert, copy) in enumerate(zip(fetched, loads)):
            outputs[expert] = pairs.output(self.fetch.mlp(index, copy), spans_of[expert], silu_mul)
            self.fetch.done(index)
        if cpu is not None:
            back = cpu.result().to(pairs.device, non_blocking=True)
            outputs.update(zip((e for e, _ in on_cpu), back.split([s.stop - s.start for _, s in on_cpu])))
        self._count(hits, misses, split)
        return outputs

    def _split(self, hits: list[Span], misses: list[Span]) -> ExpertSplit:
        if self.split_model is None:
            return NO_SPLIT
        max_fetches = 0 if self.fetch is None else self.fetch.num_buffers
        return self.split_model.split([s.stop - s.start for _, s in hits], [s.stop - s.start for _, s in misses],
                                      max_fetches)

    def _start_cpu(self, pairs: "Pairs", spans: list[Span], silu_mul: SiluMul) -> Future | None:
        """Hand the CPU its experts' pairs: the rows they come from hop to the host once with the
        CPU's pair positions (and routing weights), the CPU gathers its rows itself; the future's
        value is their outputs in the order of `spans` (weighted where `pairs.weighted`), hopping
        back once."""
        if not spans:
            return None
        queue = self.cpu.queue
        positions = torch.cat([torch.arange(s.start, s.stop) for _, s in spans]).to(pairs.device)
        hops = [queue.copy_to_host(t) for t in pairs.for_cpu(positions)]
        sizes = [s.stop - s.start for _, s in spans]
        return queue.run_on_host(lambda: self._compute_on_cpu(hops, [e for e, _ in spans], sizes, silu_mul))

    def _compute_on_cpu(self, hops: list[Future], experts: list[int], sizes: list[int],
                        silu_mul: SiluMul) -> torch.Tensor:
        start = time.perf_counter()
        source, index, *weights = (hop.result() for hop in hops)
        with self.cpu.threads():
            rows = source[index]  # [num_cpu_pairs, hidden]
            compute_start = time.perf_counter()
            out = torch.cat([self.experts[e].apply(part, silu_mul) for e, part in zip(experts, rows.split(sizes))])
            if self.split_model is not None:
                self.split_model.observe("cpu", sizes, time.perf_counter() - compute_start)
            if weights:
                out = (out * weights[0][:, None]).to(source.dtype)
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
