"""LLMEngine: one iteration at a time — schedule, execute, update, report.

The engine is synchronous; the server runs `step()` in its own loop apart from the event
loop. `add_request` checks input (engine/request.py; ParamError names the field) before anything
is queued, so bad input never reaches the model. Each step's sampled tokens go to the
scheduler's `update`, which feeds every sequence's text stream and decides which are finished.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import kernels
from engine.config import GIB_BYTES, QUANTIZATION_METHODS, EngineConfig
from engine.distributed import ModelSource, TensorParallelRunner
from engine.model_config import ModelConfig
from engine.offload.experts.cache import LayerHeat
from engine.offload.experts.store import EXPERT_STATS_KIND, HotExpertLayers, create_expert_store
from engine.offload.convert import conversion_key
from engine.offload.layer_store import create_layer_store, open_layer_files
from engine.offload.stats import WeightStats
from engine.outputs import RequestMetrics, RequestOutput
from engine.planning.fit import describe_fit
from engine.planning.stage import EnginePlan, plan_engine
from engine.planning.weights import profile_key, weight_format
from engine.profiling.cache import profile_path
from engine.request import InputProcessor, PreparedRequest, Request
from engine.runtime import ModelRunner
from engine.runtime.runner import FatalRunnerError, RunnerOutput
from engine.sampling import Sampler
from engine.speculative import create_speculator
from engine.speculative.counts import VerifyCounts
from engine.speculative.draft_model import Target
from engine.speculative.verify import verify
from engine.text import Tokenizer
from engine.weights import create_loader
from scheduler.iteration_plan import IterationPlan, PlanMode
from scheduler.neo import NeoConfig, NeoScheduler
from scheduler.planning import ModelPlan, describe_model_plan
from scheduler.planning.cost_model import CostModel, TableCostModel
from scheduler.planning.experts.hot_experts import ExpertCachePlan
from scheduler.planning.kv_format import KVFormat
from scheduler.planning.offload_cost import SlicedMlpCostModel, StreamingCostModel
from scheduler.planning.slicing.moved_tokens import MovedTokens, SolvedMovedTokens
from scheduler.planning.slicing.plan import layer_works
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.threads import DEFAULT_IO_THREADS, ThreadPlan
from scheduler.planning.tiers import Tier
from scheduler.prefix_cache import PrefixCacheCounters
from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence

logger = logging.getLogger(__name__)

@dataclass
class IterationStats:
    """What the last step did, for metrics."""

    num_prompt_tokens: int = 0  # prefill tokens computed (recomputation included)
    num_batched_tokens: int = 0  # every token the forward computed
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # the GPU pool
    # ---- offloading (Neo) --------------------------------------------------------------------
    mode: str = PlanMode.GPU_ONLY
    num_cpu_running: int = 0  # CPU-requests (their KV in the host pool)
    cpu_kv_cache_usage: float = 0.0
    num_swapped_out: int = 0  # requests moved to the host pool this iteration
    num_swapped_in: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    forward_time: float = 0.0  # seconds, swaps included
    estimated_time: float | None = None  # the cost model's prediction of forward_time
    cpu_attention_time: float = 0.0  # in the CPU decoding attention kernel
    cpu_wait_time: float = 0.0  # the CPU side waiting on the GPU (pipeline bubbles)
    # ---- weight streaming (PIPO) -------------------------------------------------------------
    weight_transfer_time: float = 0.0  # loading streamed layers (overlapping the forward)
    weight_stall_time: float = 0.0  # the GPU waiting for a streamed layer's weights
    weight_bytes_streamed: dict[str, int] = field(default_factory=dict)  # by tier (host, disk)
    # ---- speculative decoding ------------------------------------------------------------------
    speculation: VerifyCounts | None = None  # this step's drafts and what was accepted
    # ---- MLP slicing (ScheInfer): the CG parts' bytes are in weight_bytes_streamed["host"] ------
    mlp_cpu_time: float = 0.0  # the CPU computing its MLP parts (CC)
    num_mlp_moved_tokens: int = 0  # tokens whose CC units CG' computed on the GPU, summed over layers
    # ---- hot experts (MoE): routed (token, expert) pairs summed over routed layers -------------
    num_hit_pairs: int = 0  # routed to an expert in a GPU slot
    num_miss_pairs: int = 0  # routed to one that is not
    num_fetched_pairs: int = 0  # misses computed on the GPU from a fetch buffer
    num_hit_pairs_on_cpu: int = 0  # hits the CPU computed (the GPU having more than its share)
    num_expert_promotions: int = 0  # copies into a slot installed
    num_expert_demotions: int = 0
    promoted_bytes: int = 0  # copied into slots
    fetched_bytes: int = 0  # copied into fetch buffers
    # ---- prefix caching: this iteration's share of the scheduler's running totals ---------------
    prefix_cache: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)


class RequestFailedError(RuntimeError):
    """An internal error ended this request (the engine goes on serving the others)."""


@dataclass(frozen=True)
class RequestFailure:
    """A request that failed alone: its forward, its sampling or its output raised."""

    request_id: str
    reason: str


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        loader = create_loader(config.model, config.load_format, seed=config.seed)
        self.model_config: ModelConfig = loader.config
        self.tokenizer = Tokenizer.from_source(loader.tokenizer_source) if loader.tokenizer_source else None
        # how the engine runs, decided once (engine/planning/stage.py); what follows only builds it
        self.plan: EnginePlan = plan_engine(config, loader)
        plan = self.plan
        self.config = config = plan.config
        self.dtype = plan.dtype
        logger.info("compute dtype: %s (%s)", str(self.dtype).removeprefix("torch."), plan.dtype_reason)
        if kernels.SPIN_UNCAPPED:
            logger.warning("torch was imported before tandem, so its OpenMP threads spin after each op on the "
                           "cores tandem's CPU kernels need next (INT4 runs up to 2x slower): import engine "
                           "first or set GOMP_SPINCOUNT=%s", kernels.TORCH_SPIN_COUNT)
        logger.info("%s", describe_fit(plan.fit, config))
        layers = plan.layers
        if layers.placement is not None or layers.slicing is not None:
            logger.info("%s", describe_model_plan(layers, config.weights.offload_dir))
        self.weight_stats = WeightStats()  # what the layer store's parts did, read around each step
        cache = config.cache
        self.runner = self._create_runner(loader, dict(
            dtype=self.dtype, num_blocks=plan.gpu_pool.size(config), num_cpu_blocks=plan.num_cpu_blocks,
            block_size=cache.block_size, max_model_len=plan.max_model_len, decode_backend=config.decode_attention,
            seed=config.seed, linear_method=QUANTIZATION_METHODS[config.quantization],
            int4_prefill=config.int4_prefill, batch_invariant=config.batch_invariant,
            cpu_ops=config.cpu_ops, show_progress=config.show_progress, kv_cache_dtype=plan.kv_format.name,
            cuda_graph_max_batch=plan.cuda_graph_max_batch))
        num_blocks = self.runner.num_gpu_blocks
        logger.info("weights: %s; KV pool: %d blocks of %d tokens (%.2f GiB, %s)",
                    _describe_bytes(self.runner.weight_bytes()), num_blocks, cache.block_size,
                    num_blocks * plan.gpu_pool.block_bytes / GIB_BYTES, plan.kv_format.describe())
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        scheduler_config = SchedulerConfig(
            num_blocks=num_blocks, block_size=cache.block_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.batched_tokens_budget,
            enable_prefix_caching=cache.enable_prefix_caching, prefix_cache_key=self._prefix_cache_key(),
            max_prefill_slowdown=config.prefill_slowdown_limit, max_prefill_stall_s=config.prefill_stall_limit_s)
        logger.info("scheduler: %s", plan.scheduler.describe())
        self.cost_model: CostModel | None = None
        if plan.scheduler.kind == "neo":
            self.cost_model = self._load_cost_model()
            self.scheduler: Scheduler = NeoScheduler(scheduler_config,
                                                     NeoConfig.from_knobs(config.neo, plan.num_cpu_blocks),
                                                     self.cost_model)
        else:
            self.scheduler = Scheduler(scheduler_config)
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = create_speculator(config.speculative_config, Target(
                self.model_config.vocab_size, self.tokenizer, self.dtype, config.device, self.max_model_len, config.seed))
            # its own generator (seeded apart from the runner's) for unseeded requests' draws
            self._verify_sampler = Sampler(self.model_config.vocab_size, seed=config.seed + 1)
            logger.info("speculative decoding: %s", config.speculative_config.to_dict())
        eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.eos_token_ids = tuple(dict.fromkeys((*eos, *self.model_config.eos_token_ids)))
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                     self.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._failures: list[RequestFailure] = []  # failed alone since take_failures() last ran
        self._ids = itertools.count()
        self.stats = IterationStats()
        self.runner.begin_serving()

    @property
    def kv_format(self) -> KVFormat:
        return self.plan.kv_format

    @property
    def kv_bytes_per_token(self) -> int:
        return self.plan.kv_bytes_per_token

    @property
    def thread_plan(self) -> ThreadPlan:
        return self.plan.threads

    @property
    def profile_path(self) -> Path | None:
        """The cached cost tables, when profiled."""
        return self.plan.profile_path

    def _create_runner(self, loader, runner_kwargs: dict) -> ModelRunner | TensorParallelRunner:
        """The model on this process (its layers where the plan puts them), or split over
        --tensor-parallel-size ranks or --pipeline-parallel-size stages, each a Ray actor building
        its part (engine/distributed)."""
        config = self.config
        if not config.parallel.enabled:
            return ModelRunner(self.model_config, loader, device=config.device, cores=self.plan.cores,
                               layer_store=self._layer_store_factory(loader, self.plan.layers), **runner_kwargs)
        source = ModelSource(config.model, config.load_format, config.seed)
        parallel = config.parallel
        stores = [self._layer_store_factory(loader, plan) for plan in self.plan.stage_layers or (self.plan.layers,)]
        return TensorParallelRunner(self.model_config, source, config.device, parallel.tensor_parallel_size,
                                    parallel.ray_address, runner_kwargs, self.weight_stats,
                                    num_stages=parallel.pipeline_parallel_size, layer_stores=stores)

    def _prefix_cache_key(self) -> str:
        """What, besides the tokens, decides a block's K/V: the weights, how they compute, and how
        the pools store it."""
        config = self.config
        return (f"{config.model}|{config.load_format}|{self.dtype}|{config.quantization}|seed={config.seed}"
                f"|{config.weights.mlp_slicing}|kv={self.kv_format.name}|int4_prefill={config.int4_prefill}"
                f"|batch_invariant={config.batch_invariant}")

    def _layer_store_factory(self, loader, plan: ModelPlan):
        """How a runner builds its layer store for `plan` (None: every layer resident)."""
        config = self.config
        weights = config.weights
        if plan.experts is not None:
            return self._expert_store_factory(plan.experts)
        if plan.all_resident and plan.rates is None:
            return None
        files = None
        if plan.num_layers_in(Tier.DISK):  # the files checked, and the space for those to write, before any load
            key = conversion_key(config, loader.source, self.dtype)
            files = open_layer_files(plan, weights.offload_dir, key, self.model_config.num_layers)
        budget = None if weights.gpu_gib is None else int(weights.gpu_gib * GIB_BYTES)
        global_bytes = plan.placement.memory.global_bytes if plan.placement is not None else 0
        moved_tokens = self._moved_tokens(plan.rates) if plan.rates is not None else None
        return functools.partial(create_layer_store, plan, files=files,
                                 num_io_threads=self.thread_plan.split.io_threads or DEFAULT_IO_THREADS,
                                 gpu_weight_budget_bytes=budget, global_weight_bytes=global_bytes,
                                 moved_tokens=moved_tokens, stats=self.weight_stats)

    def _expert_store_factory(self, plan: ExpertCachePlan):
        """The hot-expert cache's store; the slicing models split each forward's experts between
        the sides, except on device cpu, where one thread computes both in turn; its statistics are
        kept beside them for the next run's first hot sets."""
        config = self.config
        costs = None if config.device == "cpu" else self.plan.slicing_costs
        stats_path = profile_path(profile_key(config, self.dtype), config.cpu_attention.profile_cache_dir,
                                  EXPERT_STATS_KIND)
        return functools.partial(create_expert_store, plan, stats=self.weight_stats, split_costs=costs,
                                 stats_path=stats_path)

    def _moved_tokens(self, rates: tuple[SliceRates, ...]) -> MovedTokens | None:
        """Prefill token assignment (ScheInfer sec. IV-B): how many of each forward's tokens a
        sliced layer moves to CG', solved from the plan's slicing models; None with
        --mlp-prefill-moving off, and on device cpu, where one thread computes both sides in turn:
        a move would only add the copy of CC's weights."""
        if not self.config.weights.prefill_moving:
            return None
        if self.config.device == "cpu":
            logger.info("MLP slicing: no tokens move to CG' on device cpu (nothing computes beside the CPU)")
            return None
        logger.info("MLP slicing: each forward moves the tokens the slicing models say to CG' "
                    "(--mlp-prefill-moving on)")
        return SolvedMovedTokens(rates, self.plan.slicing_costs, self._layer_works)

    def _load_cost_model(self) -> CostModel:
        """Cost tables from the given file, else this machine's profile (measured once per key);
        with streamed layers, their transfers stretch the linear stage (StreamingCostModel); with
        sliced MLPs, the CPU's share of it is charged to the CPU (SlicedMlpCostModel)."""
        model = self._load_table_cost_model()
        layers = self.plan.layers
        if "streamed" in self.plan.scheduler.layer_costs:
            model = StreamingCostModel.for_placement(model, layers.placement)
        if "sliced" not in self.plan.scheduler.layer_costs:
            return model
        return SlicedMlpCostModel(model, self._layer_works, self.plan.slicing_costs, layers.rates)

    def _layer_works(self, num_tokens: int):
        """One rank's layer's linear work at `num_tokens`, as the slicing models price it."""
        return layer_works(self.plan.rank_model_config.shape, weight_format(self.config, self.dtype), num_tokens)

    def _load_table_cost_model(self) -> CostModel:
        scheduler, cpu_attention = self.plan.scheduler, self.config.cpu_attention
        if scheduler.cost_tables:
            return TableCostModel.load(scheduler.cost_tables)
        from engine.profiling import ProfileGrid, load_or_profile

        runner, config, dtype = self.runner, self.config, self.dtype
        block_size = config.cache.block_size
        grid = ProfileGrid.quick() if cpu_attention.profile_grid == "quick" else ProfileGrid()

        def build() -> TableCostModel:
            logger.info("profiling this machine's costs for the offloading scheduler (once per model/dtype/device)")
            return runner.profile_costs(block_size=block_size, dtype=dtype, grid=grid, progress=config.show_progress,
                                        weight_stats=self.weight_stats,
                                        kv_cache_dtype=self.kv_format.name)

        if cpu_attention.force_profile and self.profile_path.exists():
            self.profile_path.unlink()
        return load_or_profile(scheduler.profile_key, build, cpu_attention.profile_cache_dir)

    def close(self) -> None:
        """Stop the runner's threads (the testbed's GPU thread), and a draft model's."""
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        if self.config.max_model_len is not None:
            return self.config.max_model_len  # the scheduler config reports it if the cache cannot hold it
        return min(self.plan.max_model_len, num_blocks * self.config.cache.block_size)

    # ---- requests -------------------------------------------------------------------------
    def prepare_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> PreparedRequest:
        """Tokenize and check without touching engine state (safe from another thread).
        Raises ParamError naming the field the engine cannot serve."""
        return self.inputs.prepare(prompt, params)

    def add_request(self, prompt: str | list[int] | PreparedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (raw, or prepared by prepare_request); returns its id."""
        prepared = prompt if isinstance(prompt, PreparedRequest) else self.inputs.prepare(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        request = Request.create(request_id, prepared, RequestMetrics(arrival_time=time.monotonic()),
                                 self.eos_token_ids, self.tokenizer)
        self._requests[request_id] = request
        for seq in request.sequences:
            self.scheduler.add_sequence(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request and free its blocks now; no further output for it."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.abort_sequences(seq.seq_id for seq in request.sequences)

    def expert_heat(self) -> dict[int, LayerHeat]:
        """Each routed layer's expert window counts and hot set, copied (safe from another thread);
        empty without a hot-expert cache."""
        if not isinstance(self.runner, ModelRunner):
            return {}
        store = self.runner.model.layer_store
        return store.cache.heat() if isinstance(store, HotExpertLayers) else {}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_sequences()

    # ---- the iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, hand the sampled tokens to the scheduler,
        and report the requests that received one."""
        prefix_cache_before = self.scheduler.prefix_cache.counters.snapshot()
        plan = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.draft(plan, self.scheduler)
        self.stats = stats = self._plan_stats(plan)
        # lookups, demotions and promotions all happen while planning (an undone admission too)
        stats.prefix_cache = self.scheduler.prefix_cache.counters.since(prefix_cache_before)
        if plan.is_empty:
            return []
        now = time.monotonic()
        for scheduled in plan.prefills:
            metrics = self._requests[scheduled.sequence.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        weights_before = self.weight_stats.snapshot()
        try:
            output = self.runner.execute(plan)
        except FatalRunnerError:
            raise
        except Exception as exc:  # noqa: BLE001 (a forward's failure is its batch's, not the server's)
            logger.exception("a forward failed; failing the %d requests in it", len(plan.scheduled))
            for scheduled in plan.scheduled:
                self._fail_request(scheduled.sequence.request_id, f"the forward of its batch failed: {exc!r}")
            return []
        stats.forward_time = output.forward_time
        self.scheduler.observe_step(plan, output.forward_time)
        self._record_weights(stats, weights_before, self.weight_stats)
        if output.pipeline is not None:
            stats.cpu_attention_time = output.pipeline.cpu_attention
            stats.cpu_wait_time = output.pipeline.cpu_waiting
        for row, entries in output.prompt_logprobs.items():
            plan.scheduled[row].sequence.add_prompt_logprobs(entries)
        sampling = plan.sampling
        for row, reason in output.sampled.failed_rows.items():
            self._fail_request(sampling[row].sequence.request_id, reason)
        updated = self.scheduler.update(plan, output.sampled.token_ids, output.sampled.token_logprobs(),
                                        on_error=self._token_failed)
        if self.speculator is not None:
            verify_start = time.perf_counter()
            updated += self._verify(plan, output) if plan.verifies else []
            # what a verify row costs includes drawing its token
            self.speculator.observe_step(plan, output.forward_time + time.perf_counter() - verify_start)
        return self._outputs({seq.request_id: self._requests[seq.request_id] for seq in updated
                              if seq.request_id in self._requests})

    def _verify(self, plan: IterationPlan, output: RunnerOutput) -> list[Sequence]:
        """Check the plan's drafts against the forward's rows and take the tokens they give
        (engine/speculative/verify.py); the sequences that received any."""
        live = [(share, rows) for share, rows in zip(plan.verifies, output.verify_logits)
                if not share.sequence.finished]  # aborted while the forward ran
        shares = [share for share, _ in live]

        def take(share, position: int, token) -> bool:
            try:
                return self.scheduler.take_verified(share, position, token)
            except Exception as exc:  # noqa: BLE001 (its detokenizer or grammar: its own failure)
                self._token_failed(share.sequence, exc)
                return False

        def fail(seq: Sequence, reason: str) -> None:
            self._fail_request(seq.request_id, reason)

        counts = verify(shares, [rows for _, rows in live], self._verify_sampler, take, fail)
        self.speculator.observe(shares, counts)
        self.stats.speculation = counts
        self.stats.num_generation_tokens += counts.num_emitted_tokens
        return [share.sequence for share in shares]

    def take_failures(self) -> list[RequestFailure]:
        """The requests that failed since the last call, each alone (the others go on); they have
        left the engine."""
        failures, self._failures = self._failures, []
        return failures

    def _fail_request(self, request_id: str, reason: str) -> None:
        if request_id in self._requests:
            logger.warning("request %s failed: %s", request_id, reason)
            self.abort_request(request_id)
            self._failures.append(RequestFailure(request_id, reason))

    def _token_failed(self, seq, exc: Exception) -> None:
        logger.error("taking request %s's token failed", seq.request_id, exc_info=exc)
        self._fail_request(seq.request_id, f"taking its token failed: {exc!r}")

    @staticmethod
    def _record_weights(stats: IterationStats, before: WeightStats, after: WeightStats) -> None:
        """This iteration's share of the layer store's running totals: the ring's loads, the CPU's
        MLP parts, CG''s moved tokens, the hot-expert cache's pairs and copies (each where that
        part exists)."""
        if after.streams:
            stats.weight_transfer_time = after.transfer_s - before.transfer_s
            stats.weight_stall_time = after.stall_s - before.stall_s
            stats.weight_bytes_streamed = {tier: after.bytes_by_tier[tier] - before.bytes_by_tier.get(tier, 0)
                                           for tier in after.bytes_by_tier}
        if after.slices:
            stats.mlp_cpu_time = after.cc_s - before.cc_s
        if after.moves:
            stats.num_mlp_moved_tokens = after.num_moved_tokens - before.num_moved_tokens
            logger.debug("MLP slicing: CG' computed %d tokens' CC units (summed over layers)",
                         stats.num_mlp_moved_tokens)
        if after.experts:
            stats.num_hit_pairs = after.num_hit_pairs - before.num_hit_pairs
            stats.num_miss_pairs = after.num_miss_pairs - before.num_miss_pairs
            stats.num_fetched_pairs = after.num_fetched_pairs - before.num_fetched_pairs
            stats.num_hit_pairs_on_cpu = after.num_hit_pairs_on_cpu - before.num_hit_pairs_on_cpu
            stats.num_expert_promotions = after.num_expert_promotions - before.num_expert_promotions
            stats.num_expert_demotions = after.num_expert_demotions - before.num_expert_demotions
            stats.promoted_bytes = after.promoted_bytes - before.promoted_bytes
            stats.fetched_bytes = after.fetched_bytes - before.fetched_bytes

    def _plan_stats(self, plan: IterationPlan) -> IterationStats:
        stats = IterationStats(
            num_prompt_tokens=sum(s.num_new_tokens for s in plan.prefills),
            num_batched_tokens=plan.num_batched_tokens,
            num_generation_tokens=len(plan.sampling), num_preemptions=len(plan.preempted),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.block_pool.usage, mode=plan.mode,
            num_swapped_out=len(plan.swap_out), num_swapped_in=len(plan.swap_in),
            num_blocks_swapped_out=sum(len(s.src_blocks) for s in plan.swap_out),
            num_blocks_swapped_in=sum(len(s.src_blocks) for s in plan.swap_in),
            estimated_time=plan.estimated_time)
        if isinstance(self.scheduler, NeoScheduler):
            stats.num_cpu_running = self.scheduler.num_cpu_running
            stats.cpu_kv_cache_usage = self.scheduler.cpu_pool.usage
        return stats

    def _outputs(self, requests: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests that received tokens; finished ones leave the engine. A
        request whose output cannot be made (its detokenizer raised) fails alone."""
        now = time.monotonic()
        outputs = []
        for request in requests.values():
            request.metrics.first_token_time = request.metrics.first_token_time or now
            try:
                output = request.take_output()
            except Exception as exc:  # noqa: BLE001
                logger.error("making request %s's output failed", request.request_id, exc_info=exc)
                self._fail_request(request.request_id, f"making its output failed: {exc!r}")
                continue
            if request.finished:
                request.metrics.finished_time = now
                del self._requests[request.request_id]
            outputs.append(output)
        return outputs


def _describe_bytes(bytes_by_format_tier: dict[tuple[str, str], int]) -> str:
    """"0.50 GiB (float32 on the GPU 0.50 GiB)": the total, then each part."""
    parts = ", ".join(f"{fmt} on the {tier} {nbytes / 2**30:.2f} GiB"
                      for (fmt, tier), nbytes in sorted(bytes_by_format_tier.items()))
    return f"{sum(bytes_by_format_tier.values()) / 2**30:.2f} GiB ({parts})"
