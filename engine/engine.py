"""LLMEngine: one iteration at a time — schedule, execute, update, detokenize.

The engine is synchronous; the server runs `step()` in its own loop apart from the event
loop. `add_request` validates input (ParamError names the field) before anything is queued,
so bad input never reaches the model.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model import ConfigError, ModelConfig
from engine.kv import KVCache
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from engine.execution import CoreAssignment, ModelRunner
from engine.profiling import compute_dtype
from engine.text import IncrementalDetokenizer, Tokenizer
from engine.weights import create_loader
from scheduler.request import ParamError, Request, RequestStatus, SamplingParams
from scheduler.cost_model import CostModel, TableCostModel
from scheduler.neo import NeoConfig, NeoScheduler
from scheduler.scheduler import PlanMode, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

# Without an explicit max_model_len, contexts are capped here to keep prefill buffers sane.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass(frozen=True)
class PreparedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class IterationStats:
    """What the last step did, for metrics."""

    num_prompt_tokens: int = 0  # prefill tokens computed (recomputation included)
    num_batched_tokens: int = 0  # every token the forward computed
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # the accelerator pool
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
    cpu_wait_time: float = 0.0  # the CPU side waiting on the accelerator (pipeline bubbles)


@dataclass
class _Sequence:
    """One of a request's n samples, with its text state."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence]
    metrics: RequestMetrics


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loader = create_loader(config.model, config.load_format, seed=config.seed)
        self.model_config: ModelConfig = loader.config
        self.tokenizer = Tokenizer.from_source(loader.tokenizer_source) if loader.tokenizer_source else None
        # resolved here, once: `auto` runs the dtype probe, and everything after uses this value
        self.dtype, reason = compute_dtype(config.dtype, config.torch_device)
        logger.info("compute dtype: %s (%s)", str(self.dtype).removeprefix("torch."), reason)
        cache = config.cache
        block_bytes = KVCache.bytes_per_block(self.model_config, cache.block_size, self.dtype)
        num_blocks = cache.num_gpu_blocks_for(block_bytes)
        num_cpu_blocks = cache.num_cpu_blocks_for(block_bytes) if config.offloading else 0
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        scheduler_config = SchedulerConfig(
            num_blocks=num_blocks, block_size=cache.block_size, max_model_len=self.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        offload = config.offload
        cores = CoreAssignment.for_device(config.device, offload.accelerator_threads, offload.cpu_attention_threads)
        self.runner = ModelRunner(
            self.model_config, loader, dtype=self.dtype, device=config.device, num_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks, cores=cores, block_size=cache.block_size,
            max_model_len=self.max_model_len, decode_backend=config.decode_attention, seed=config.seed,
            show_progress=config.show_progress)
        self.cost_model: CostModel | None = None
        self.profile_path: Path | None = None  # the cached cost tables, when profiled
        if num_cpu_blocks:
            self.cost_model = self._load_cost_model(loader, self.dtype)
            self.scheduler: Scheduler = NeoScheduler(scheduler_config, NeoConfig.from_knobs(config.neo, num_cpu_blocks),
                                                     self.cost_model)
        else:
            self.scheduler = Scheduler(scheduler_config)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        self.eos_token_ids = tuple(dict.fromkeys((*eos, *self.model_config.eos_token_ids)))
        self._groups: dict[str, _Group] = {}
        self._sequences: dict[str, tuple[_Group, _Sequence]] = {}  # by child request id
        self._ids = itertools.count()
        self.stats = IterationStats()

    def _load_cost_model(self, loader, dtype: torch.dtype) -> CostModel:
        """Cost tables from the given file, else this machine's profile (measured once per key)."""
        config, offload = self.config, self.config.offload
        if offload.cost_tables:
            return TableCostModel.load(offload.cost_tables)
        from engine.profiling import ProfileGrid, ProfileKey, load_or_profile, profile_costs, profile_path

        runner = self.runner
        block_size = config.cache.block_size
        key = ProfileKey.create(model=config.model, load_format=config.load_format, dtype=dtype,
                                device=config.device, accelerator_threads=runner.cores.accelerator_threads,
                                cpu_attention_threads=runner.cores.cpu_attention_threads,
                                block_size=block_size)
        grid = ProfileGrid.quick() if offload.profile_grid == "quick" else ProfileGrid()

        def build() -> TableCostModel:
            logger.info("profiling this machine's costs for the offloading scheduler (once per model/dtype/device)")
            with runner.cores.on_cpu_cores():
                return profile_costs(runner.model, runner.accelerator, runner.model.decode_backend, runner.cpu_decode,
                                     block_size=block_size, dtype=dtype, grid=grid,
                                     progress=config.show_progress)

        self.profile_path = profile_path(key, offload.profile_cache_dir)
        if offload.force_profile and self.profile_path.exists():
            self.profile_path.unlink()
        return load_or_profile(key, build, offload.profile_cache_dir)

    def close(self) -> None:
        """Stop the runner's threads (the testbed's accelerator thread)."""
        self.runner.close()

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        capacity = num_blocks * self.config.cache.block_size
        trained = self.model_config.max_position_embeddings
        if self.config.max_model_len is not None:
            if self.config.max_model_len > trained:
                raise ConfigError(f"max_model_len ({self.config.max_model_len}) exceeds the model's context "
                                  f"length ({trained})")
            return self.config.max_model_len  # the scheduler config reports it if the cache cannot hold it
        return min(trained, DEFAULT_MAX_MODEL_LEN_CAP, capacity)

    # ---- requests -------------------------------------------------------------------------
    def prepare_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> "PreparedRequest":
        """Tokenize and validate without touching engine state (safe from another thread).
        Raises ParamError naming the field the engine cannot serve."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self._tokenize_prompt(prompt)
        params = self._check_lengths(prompt_ids, params)
        vocab = self.model_config.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ParamError("logit_bias", f"logit_bias has token ids outside the vocabulary (size {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids has ids outside the vocabulary (size {vocab})")
        return PreparedRequest(prompt_text, prompt_ids, params)

    def add_request(self, prompt: "str | list[int] | PreparedRequest", params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (raw, or prepared by prepare_request); returns its id."""
        prepared = prompt if isinstance(prompt, PreparedRequest) else self.prepare_request(prompt, params)
        params, prompt_ids = prepared.params, prepared.prompt_token_ids
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise ParamError("request_id", f"request id {request_id!r} is already in use")
        group = _Group(request_id, prepared.prompt, prompt_ids, [], RequestMetrics(arrival_time=time.monotonic()))
        for index in range(params.n):
            child_params = params
            if params.n > 1:  # each sample its own stream; seeded ones stay reproducible
                child_params = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, list(prompt_ids), child_params, eos_token_ids=self.eos_token_ids,
                              arrival_time=group.metrics.arrival_time)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, child_params) if self.tokenizer else None
            seq = _Sequence(index, request, detok, logprobs=[] if params.logprobs is not None else None)
            group.sequences.append(seq)
            self._sequences[child_id] = (group, seq)
        self._groups[request_id] = group
        for seq in group.sequences:
            self.scheduler.add_request(seq.request)
        return request_id

    def _tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this model has no tokenizer (dummy weights): pass token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids = list(prompt)
            text = None
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ParamError("prompt", "the prompt is empty")
        return text, ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ParamError("prompt", f"the prompt has {len(prompt_ids)} tokens; this model's context "
                                       f"length is {limit}, leaving no room to generate")
        if params.max_tokens is None:
            return replace(params, max_tokens=limit - len(prompt_ids))
        if len(prompt_ids) + params.max_tokens > limit:
            raise ParamError("max_tokens", f"this model's context length is {limit} tokens, but "
                                           f"{len(prompt_ids)} prompt tokens + {params.max_tokens} max_tokens "
                                           f"= {len(prompt_ids) + params.max_tokens}")
        return params

    def abort_request(self, request_id: str) -> None:
        """Abort a request and free its blocks now; no further output for it."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self._sequences.pop(seq.request.request_id, None)
        self.scheduler.abort_requests(seq.request.request_id for seq in group.sequences)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.stats = stats = IterationStats(
            num_prompt_tokens=sum(s.num_new_tokens for s in plan.prefills),
            num_batched_tokens=plan.num_batched_tokens,
            num_generation_tokens=len(plan.scheduled), num_preemptions=len(plan.preempted),
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.block_pool.usage, mode=plan.mode,
            num_swapped_out=len(plan.swap_out), num_swapped_in=len(plan.swap_in),
            num_blocks_swapped_out=sum(len(s.src_blocks) for s in plan.swap_out),
            num_blocks_swapped_in=sum(len(s.src_blocks) for s in plan.swap_in),
            estimated_time=plan.estimated_time)
        if isinstance(self.scheduler, NeoScheduler):
            stats.num_cpu_running = self.scheduler.num_cpu_running
            stats.cpu_kv_cache_usage = self.scheduler.cpu_pool.usage
        if plan.is_empty:
            return []
        now = time.monotonic()
        for seq in plan.prefills:
            group, _ = self._sequences[seq.request.request_id]
            group.metrics.first_scheduled_time = group.metrics.first_scheduled_time or now
        output = self.runner.execute(plan)
        stats.forward_time = output.forward_time
        if output.pipeline is not None:
            stats.cpu_attention_time = output.pipeline.cpu_attention
            stats.cpu_wait_time = output.pipeline.cpu_waiting
        updated = {id(r) for r in self.scheduler.update(plan, output.sampled_token_ids)}
        sampled = output.sampled
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        for row, scheduled in enumerate(plan.scheduled):
            request = scheduled.request
            if id(request) not in updated:
                continue
            group, seq = self._sequences[request.request_id]
            token_id = request.output_token_ids[-1]
            seq.delta_token_ids.append(token_id)
            if seq.logprobs is not None:
                entry = TokenLogprob(token_id, sampled.logprobs[row], sampled.top_logprobs[row] or [])
                seq.logprobs.append(entry)
                seq.delta_logprobs.append(entry)
            if seq.detokenizer is not None:
                seq.delta_text += seq.detokenizer.add(token_id)
                if seq.detokenizer.stop_string is not None and not request.finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED,
                                                  stop_reason=seq.detokenizer.stop_string)
                elif request.finished:
                    seq.delta_text += seq.detokenizer.finish()
            group.metrics.first_token_time = group.metrics.first_token_time or now
            group.metrics.num_preemptions = sum(s.request.num_preemptions for s in group.sequences)
            touched[group.request_id] = group
        return [self._make_output(group, now) for group in touched.values()]

    def _make_output(self, group: _Group, now: float) -> RequestOutput:
        outputs = []
        for seq in group.sequences:
            request = seq.request
            seq.text += seq.delta_text
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(request.output_token_ids),
                finish_reason=request.status.value if request.finished else None,
                stop_reason=request.stop_reason, logprobs=seq.logprobs,
                delta_text=seq.delta_text, delta_token_ids=seq.delta_token_ids,
                delta_logprobs=seq.delta_logprobs if seq.logprobs is not None else None,
            ))
            seq.delta_text, seq.delta_token_ids, seq.delta_logprobs = "", [], []
        finished = all(seq.request.finished for seq in group.sequences)
        if finished:
            group.metrics.finished_time = now
            del self._groups[group.request_id]
            for seq in group.sequences:
                del self._sequences[seq.request.request_id]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             group.metrics)
