"""Prometheus metrics, named like vLLM V1's under the `tandem:` prefix so dashboards carry over."""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine.engine import LLMEngine
from engine.offload.experts.cache import LayerHeat
from engine.outputs import RequestOutput
from scheduler.planning import TIER_DISK, TIER_HOST
from scheduler.iteration_plan import PLAN_MODES
from scheduler.sequence import SequenceStatus, Tier
from scheduler.planning.threads import THREAD_TASKS, ThreadSplit

STREAMED_TIERS = (TIER_HOST, TIER_DISK)  # where streamed layers come from
KV_TIERS = tuple(tier.value for tier in Tier)  # where a request's KV lives
FINISH_REASONS = tuple(status.value for status in SequenceStatus if status.finished)
SWAP_OUT, SWAP_IN = "out", "in"  # to the host pool, back to the GPU's
SWAP_DIRECTIONS = (SWAP_OUT, SWAP_IN)
# a routed (token, expert) pair: to an expert in a GPU slot (hot) or not (cold), computed where
EXPERT_HOT, EXPERT_COLD = "hot", "cold"
EXPERT_GPU, EXPERT_CPU = "gpu", "cpu"
EXPERT_PAIR_KINDS = tuple((expert, placement) for expert in (EXPERT_HOT, EXPERT_COLD)
                          for placement in (EXPERT_GPU, EXPERT_CPU))
EXPERT_PROMOTED, EXPERT_FETCHED = "promoted", "fetched"  # what an expert copy was for: a slot, or one forward
EXPERT_COPY_KINDS = (EXPERT_PROMOTED, EXPERT_FETCHED)

# the endpoints whose requests tandem:api_requests counts, each by its protocol's path
API_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
                 "/v1/responses")

disable_created_metrics()  # the *_created series only clutter dashboards (vLLM turns them off too)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"tandem:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"tandem:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"tandem:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the decode runqueue.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be prefilled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of the GPU KV pool's blocks requests hold (0-1); cached-but-free "
            "blocks count as free (tandem:kv_cached_blocks reports them).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self._success = Counter("tandem:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between tokens.",
                                             _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                                             _LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                            _LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine iteration.",
                                          _TOKEN_BUCKETS)
        self._weight_bytes = Gauge("tandem:weight_bytes", "Bytes of the model's weights by storage format and "
                                   "where they live (gpu: resident, and the buffers streamed layers pass "
                                   "through; host, disk: streamed layers).", ["model_name", "format", "tier"],
                                   registry=r)
        self._kv_bytes_per_token = Gauge("tandem:kv_cache_bytes_per_token", "Bytes one token's keys and values "
                                         "take in the KV pools, every layer, by the pools' format (float16, int8, "
                                         "int4, ...): scales included.", ["model_name", "format"], registry=r)
        self._threads = Gauge("tandem:threads", "Host threads each task takes, as planned at start: gpu (the "
                              "testbed's cores playing the GPU; 0 elsewhere), cpu (the CPU side's decoding attention "
                              "and CC parts), copy (the host copy engine; 0 where a DMA engine copies), io (O_DIRECT "
                              "reads in flight).", ["model_name", "task"], registry=r)
        # ---- offloading (Neo): per tier, per mode, swaps, CPU attention, cost-model error ----------
        self._tier_running = Gauge("tandem:num_requests_running_by_tier",
                                   "Running requests by where their KV lives (gpu: GPU pool, cpu: host pool).",
                                   ["model_name", "tier"], registry=r)
        self._tier_usage = Gauge("tandem:kv_cache_usage_perc_by_tier", "Fraction of each KV pool's blocks "
                                 "requests hold (0-1); cached-but-free blocks count as free "
                                 "(tandem:kv_cached_blocks reports them).", ["model_name", "tier"], registry=r)
        self._iterations = Counter("tandem:iterations", "Engine iterations by plan mode (gpu_only, pipelined).",
                                   ["model_name", "mode"], registry=r)
        self._swaps = Counter("tandem:swapped_requests", "Requests moved between the KV pools (out: to the CPU).",
                              ["model_name", "direction"], registry=r)
        self._swapped_blocks = Counter("tandem:swapped_blocks", "KV blocks moved between the pools.",
                                       ["model_name", "direction"], registry=r)
        self.cpu_service_rate = gauge(
            "cpu_runqueue_service_rate", "CPU decodes placed per iteration lately (0 before any was to place).")
        self.cpu_admission_limit = gauge(
            "cpu_admission_limit", "CPU-requests beyond which prefills wait instead of entering the host pool.")
        self.cpu_attention_seconds = counter("cpu_attention_seconds", "Time in the CPU decoding attention kernel.")
        self.pipeline_cpu_wait_seconds = counter(
            "pipeline_cpu_wait_seconds", "Pipelined iterations: time the CPU side waited on the GPU (bubbles).")
        self.forward_seconds = histogram("iteration_forward_seconds", "Measured forward time per iteration.",
                                         _LATENCY_BUCKETS)
        self.cost_model_error = histogram(
            "cost_model_relative_error", "|measured - predicted| / measured forward time, per iteration.",
            _ERROR_BUCKETS)
        self._api_requests = Counter("tandem:api_requests", "HTTP requests by endpoint (each protocol's path) "
                                     "and the status answered.", ["model_name", "endpoint", "status"], registry=r)
        self._add_weight_metrics(r, counter, histogram)
        self._add_prefix_cache_metrics(r, counter)
        self._add_expert_metrics(r, counter)
        self._add_speculation_metrics(r, counter)
        self._last_token_time: dict[str, float] = {}
        self._initialise_labelled_series()

    def _add_weight_metrics(self, r: CollectorRegistry, counter, histogram) -> None:
        # ---- weight streaming (PIPO): bytes per tier, transfer against compute, stalls -------------
        self._weight_streamed_bytes = Counter(
            "tandem:weight_streamed_bytes", "Bytes of streamed layers loaded into the GPU's buffers, by the "
            "tier they came from (host, disk).", ["model_name", "tier"], registry=r)
        self.weight_transfer_seconds = counter(
            "weight_transfer_seconds", "Time spent loading streamed layers (overlaps compute in the pipeline).")
        self.weight_stall_seconds = counter(
            "weight_stall_seconds", "Time the GPU waited for a streamed layer's weights (pipeline stalls).")
        self.iteration_weight_transfer = histogram(
            "iteration_weight_transfer_seconds", "Per iteration with streamed layers: time loading them.",
            _LATENCY_BUCKETS)
        self.iteration_compute = histogram(
            "iteration_compute_seconds", "Per iteration with streamed layers: forward time less weight stalls.",
            _LATENCY_BUCKETS)
        # ---- MLP slicing (ScheInfer): CG's bytes are weight_streamed_bytes{tier="host"} ----------------
        self.mlp_cpu_seconds = counter(
            "mlp_cpu_seconds", "Time the CPU computed its slices of the MLPs (CC), beside the GPU's.")
        self.mlp_moved_tokens = counter(
            "mlp_moved_tokens", "Tokens whose CPU slices of an MLP (CC) the GPU computed instead, with CC's "
            "weights copied over (CG', prefill token assignment), summed over layers.")

    def _add_prefix_cache_metrics(self, r: CollectorRegistry, counter) -> None:
        # ---- prefix caching: tokens per KV tier looked up (tier gpu: every admitted prompt; cpu: what
        # the GPU pool missed), so the overall hit rate is the hits of both over the gpu queries ------
        self._prefix_queries = Counter(
            "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, by KV tier (gpu: every "
            "admitted prompt's tokens; cpu: the host pool asked for what the GPU pool missed).",
            ["model_name", "tier"], registry=r)
        self._prefix_hits = Counter(
            "tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed), by the KV tier "
            "that held them.", ["model_name", "tier"], registry=r)
        self._cached_blocks = Gauge(
            "tandem:kv_cached_blocks", "Free KV blocks still holding a cached prefix, by pool (cpu: 0 without a "
            "host pool); an allocation may take them, least recently used first.", ["model_name", "tier"],
            registry=r)
        self.prefix_demoted_blocks = counter(
            "prefix_cache_demoted_blocks", "Cached blocks the GPU pool evicted that were copied into the host pool.")
        self.prefix_promoted_blocks = counter(
            "prefix_cache_promoted_blocks", "Cached blocks found in the host pool that were copied into the GPU pool.")

    def _add_expert_metrics(self, r: CollectorRegistry, counter) -> None:
        # ---- the hot-expert cache (MoE): pairs by where they computed, the hot sets' changes; the
        # windows and hot sets themselves are read when scraped (`watch_experts`) ---------------------
        self._expert_pairs = Counter(
            "tandem:moe_routed_pairs", "Routed (token, expert) pairs of the hot-expert cache's layers, summed over "
            "layers, by their expert (hot: in one of its layer's GPU slots; cold: not) and where they computed "
            "(gpu: a hot expert from its slot, a cold one fetched into a buffer for that forward; cpu: by the CPU, "
            "a hot one where the GPU had more than its share); the hit rate is hot over all.",
            ["model_name", "expert", "placement"], registry=r)
        self.expert_promotions = counter(
            "moe_expert_promotions", "Experts installed in a GPU slot once their copy landed (the hot set's entries).")
        self.expert_demotions = counter(
            "moe_expert_demotions", "Experts dropped from a GPU slot for a hotter one (no copy: the CPU computes "
            "them from host memory).")
        self._expert_copied_bytes = Counter(
            "tandem:moe_expert_copied_bytes", "Bytes of expert weights copied onto the GPU, by what for (promoted: "
            "into a slot; fetched: into a buffer for one forward).", ["model_name", "kind"], registry=r)

    def _add_speculation_metrics(self, r: CollectorRegistry, counter) -> None:
        # ---- speculative decoding, as vLLM V1 counts it: acceptance rate = accepted / draft tokens,
        # mean accepted length = 1 + accepted / drafts ---------------------------------------------
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Verify shares: decodes that carried drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens the target accepted.")
        self._spec_accepted_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position of a verify "
            "(0: the first draft).", ["model_name", "position"], registry=r)

    def record_api_request(self, endpoint: str, status: int) -> None:
        self._api_requests.labels(self._model_name, endpoint, str(status)).inc()

    def _initialise_labelled_series(self) -> None:
        """A series for every known label value from the start, at 0, so a fresh dashboard shows 0
        rather than "No data" (a labelled metric exports nothing until `.labels()` is called).
        weight_bytes is set once the weights are loaded (`record_weights`)."""
        name = self._model_name
        for reason in FINISH_REASONS:
            self._success.labels(name, reason)
        for endpoint in API_ENDPOINTS:
            self._api_requests.labels(name, endpoint, "200")
        for mode in PLAN_MODES:
            self._iterations.labels(name, mode)
        for tier in KV_TIERS:
            self._tier_running.labels(name, tier)
            self._tier_usage.labels(name, tier)
            self._prefix_queries.labels(name, tier)
            self._prefix_hits.labels(name, tier)
            self._cached_blocks.labels(name, tier)
        for direction in SWAP_DIRECTIONS:
            self._swaps.labels(name, direction)
            self._swapped_blocks.labels(name, direction)
        for tier in STREAMED_TIERS:  # at 0 where nothing streams
            self._weight_streamed_bytes.labels(name, tier)
        for task in THREAD_TASKS:  # set by record_threads once the split is planned
            self._threads.labels(name, task)
        for expert, placement in EXPERT_PAIR_KINDS:  # at 0 without a hot-expert cache
            self._expert_pairs.labels(name, expert, placement)
        for kind in EXPERT_COPY_KINDS:
            self._expert_copied_bytes.labels(name, kind)
        self._spec_accepted_per_pos.labels(name, "0")  # at 0 without speculation; later positions as they come

    def request_success(self, finished_reason: str):
        return self._success.labels(self._model_name, finished_reason)

    def record_iteration(self, engine: LLMEngine, outputs: list[RequestOutput], _elapsed: float) -> None:
        """Called on the engine thread after every step."""
        stats = engine.stats
        now = time.monotonic()
        self.num_preemptions.inc(stats.num_preemptions)
        self.iteration_tokens.observe(stats.num_batched_tokens)
        self._record_prefix_cache(stats)
        if stats.num_batched_tokens:
            name = self._model_name
            self._iterations.labels(name, stats.mode).inc()
            self._swaps.labels(name, SWAP_OUT).inc(stats.num_swapped_out)
            self._swaps.labels(name, SWAP_IN).inc(stats.num_swapped_in)
            self._swapped_blocks.labels(name, SWAP_OUT).inc(stats.num_blocks_swapped_out)
            self._swapped_blocks.labels(name, SWAP_IN).inc(stats.num_blocks_swapped_in)
            self.cpu_attention_seconds.inc(stats.cpu_attention_time)
            self.pipeline_cpu_wait_seconds.inc(stats.cpu_wait_time)
            self.mlp_cpu_seconds.inc(stats.mlp_cpu_time)
            self.mlp_moved_tokens.inc(stats.num_mlp_moved_tokens)
            self.forward_seconds.observe(stats.forward_time)
            if stats.estimated_time is not None and stats.forward_time > 0:
                self.cost_model_error.observe(abs(stats.forward_time - stats.estimated_time) / stats.forward_time)
            if stats.weight_bytes_streamed:
                self._record_streaming(stats)
            self._record_experts(stats)
            if stats.speculation is not None:
                self._record_speculation(stats.speculation)
        for output in outputs:
            new_tokens = sum(len(c.delta_token_ids) for c in output.outputs)
            self.generation_tokens.inc(new_tokens)
            m = output.metrics
            last = self._last_token_time.get(output.request_id)
            if last is None:
                self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
                if m.first_scheduled_time is not None:
                    self.request_queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self.prompt_tokens.inc(len(output.prompt_token_ids))
            else:
                self.inter_token_latency.observe(now - last)
            self._last_token_time[output.request_id] = now
            if output.finished:
                del self._last_token_time[output.request_id]
                self.e2e_request_latency.observe(now - m.arrival_time)
                for completion in output.outputs:
                    self.request_success(completion.finish_reason).inc()
        self._record_state(engine)  # last: idle gauges imply the counters are complete

    def _record_streaming(self, stats) -> None:
        for tier, nbytes in stats.weight_bytes_streamed.items():
            self._weight_streamed_bytes.labels(self._model_name, tier).inc(nbytes)
        self.weight_transfer_seconds.inc(stats.weight_transfer_time)
        self.weight_stall_seconds.inc(stats.weight_stall_time)
        self.iteration_weight_transfer.observe(stats.weight_transfer_time)
        self.iteration_compute.observe(max(0.0, stats.forward_time - stats.weight_stall_time))

    def _record_experts(self, stats) -> None:
        name = self._model_name
        pairs = {(EXPERT_HOT, EXPERT_GPU): stats.num_hit_pairs - stats.num_hit_pairs_on_cpu,
                 (EXPERT_HOT, EXPERT_CPU): stats.num_hit_pairs_on_cpu,
                 (EXPERT_COLD, EXPERT_GPU): stats.num_fetched_pairs,
                 (EXPERT_COLD, EXPERT_CPU): stats.num_miss_pairs - stats.num_fetched_pairs}
        for (expert, placement), num_pairs in pairs.items():
            self._expert_pairs.labels(name, expert, placement).inc(num_pairs)
        self.expert_promotions.inc(stats.num_expert_promotions)
        self.expert_demotions.inc(stats.num_expert_demotions)
        self._expert_copied_bytes.labels(name, EXPERT_PROMOTED).inc(stats.promoted_bytes)
        self._expert_copied_bytes.labels(name, EXPERT_FETCHED).inc(stats.fetched_bytes)

    def _record_speculation(self, counts) -> None:
        self.spec_decode_num_drafts.inc(counts.num_drafts)
        self.spec_decode_num_draft_tokens.inc(counts.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(counts.num_accepted_tokens)
        for position, count in enumerate(counts.accepted_per_position):
            self._spec_accepted_per_pos.labels(self._model_name, str(position)).inc(count)

    def _record_prefix_cache(self, stats) -> None:
        counts, name = stats.prefix_cache, self._model_name
        for tier in KV_TIERS:
            self._prefix_queries.labels(name, tier).inc(counts.queries[tier])
            self._prefix_hits.labels(name, tier).inc(counts.hits[tier])
        self.prefix_demoted_blocks.inc(counts.num_demoted_blocks)
        self.prefix_promoted_blocks.inc(counts.num_promoted_blocks)

    def _record_state(self, engine: LLMEngine) -> None:
        """Set the gauges from the scheduler."""
        self.num_requests_running.set(engine.scheduler.num_running)
        self.num_requests_waiting.set(engine.scheduler.num_waiting)
        self.kv_cache_usage_perc.set(engine.scheduler.block_pool.usage)
        scheduler, name = engine.scheduler, self._model_name
        num_cpu_running = getattr(scheduler, "num_cpu_running", 0)
        gpu, cpu = Tier.GPU.value, Tier.CPU.value
        self._tier_running.labels(name, gpu).set(scheduler.num_running - num_cpu_running)
        self._tier_running.labels(name, cpu).set(num_cpu_running)
        self._tier_usage.labels(name, gpu).set(scheduler.block_pool.usage)
        cpu_pool = getattr(scheduler, "cpu_pool", None)
        self._tier_usage.labels(name, cpu).set(cpu_pool.usage if cpu_pool is not None and cpu_pool.num_blocks else 0.0)
        self._cached_blocks.labels(name, gpu).set(scheduler.block_pool.num_cached_blocks)
        self._cached_blocks.labels(name, cpu).set(cpu_pool.num_cached_blocks if cpu_pool is not None else 0)
        if cpu_pool is not None:  # the Neo scheduler's backpressure (+Inf until it has a rate)
            self.cpu_service_rate.set(scheduler.cpu_service_rate or 0.0)
            self.cpu_admission_limit.set(scheduler.max_cpu_admitted)

    def record_abort(self, engine: LLMEngine, request_id: str, num_sequences: int) -> None:
        """Called on the engine thread for a request aborted before it finished. An abort that
        empties the engine is followed by no iteration, so the gauges are refreshed here too."""
        self._last_token_time.pop(request_id, None)
        self.request_success(SequenceStatus.FINISHED_ABORTED.value).inc(num_sequences)
        self._record_state(engine)

    def record_weights(self, weight_bytes: dict[tuple[str, str], int]) -> None:
        """The model's weight bytes by (format, tier), set once the weights are loaded."""
        for (fmt, tier), nbytes in weight_bytes.items():
            self._weight_bytes.labels(self._model_name, fmt, tier).set(nbytes)

    def record_kv_format(self, fmt: str, bytes_per_token: int) -> None:
        """The KV pools' format and what a token takes in it, set once the pools exist."""
        self._kv_bytes_per_token.labels(self._model_name, fmt).set(bytes_per_token)

    def record_threads(self, split: ThreadSplit) -> None:
        """The host threads each task takes (scheduler/planning/threads.py), set once the split is planned."""
        for task, num_threads in split.by_task().items():
            self._threads.labels(self._model_name, task).set(num_threads)

    def watch_experts(self, read_heat: Callable[[], dict[int, LayerHeat]]) -> None:
        """Export the hot-expert cache's windows and hot sets, read by `read_heat` (LLMEngine.expert_heat)
        when /metrics is scraped."""
        self.registry.register(ExpertHeatCollector(self._model_name, read_heat))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ExpertHeatCollector:
    """tandem:moe_expert_window_pairs and tandem:moe_hot_expert, one series per routed layer and
    expert, built from the engine's copy when /metrics is scraped: a big model's layers x experts
    (48 x 128) are too many series to set on every iteration. A model without the cache exports
    neither family."""

    WINDOW_PAIRS, HOT = "tandem:moe_expert_window_pairs", "tandem:moe_hot_expert"
    LABELS = ("model_name", "layer", "expert")

    def __init__(self, model_name: str, read_heat: Callable[[], dict[int, LayerHeat]]) -> None:
        self.model_name = model_name
        self.read_heat = read_heat

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families({})

    def collect(self) -> list[GaugeMetricFamily]:
        heat = self.read_heat()
        return self._families(heat) if heat else []

    def _families(self, heat: dict[int, LayerHeat]) -> list[GaugeMetricFamily]:
        window = GaugeMetricFamily(self.WINDOW_PAIRS, "Routed (token, expert) pairs per expert of each routed layer "
                                   "in its sliding window of recent tokens: what chooses the hot set (the heat map).",
                                   labels=self.LABELS)
        hot = GaugeMetricFamily(self.HOT, "1 where the expert computes from one of its layer's GPU slots now (its "
                                "copy installed), else 0.", labels=self.LABELS)
        for layer, entry in sorted(heat.items()):
            for expert, num_pairs in enumerate(entry.window_pairs):
                labels = [self.model_name, str(layer), str(expert)]
                window.add_metric(labels, num_pairs)
                hot.add_metric(labels, 1 if expert in entry.hot else 0)
        return [window, hot]
