"""Scheduler v0: prefill waitqueue + decode runqueue, one mixed batch per iteration.

Each iteration every running request decodes one token and waiting requests are admitted as
prefills while `max_num_seqs`, `max_num_batched_tokens` and the block pool allow (Orca's
selective batching: prefills and decodes share the linear layers of one forward). When a
running request needs a block and none is free, the newest running request is preempted:
its blocks are freed and it goes back to the front of the waitqueue, to be recomputed from
its prompt plus the tokens it already generated. Nothing is lost.

The scheduler only moves plain Python objects; the runner executes the plan it returns.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from scheduler.block_pool import BlockPool, blocks_for
from scheduler.request import Request, RequestStatus


class SchedulerConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: max(max_model_len, 2048)
    # Blocks kept free when admitting a prefill, so running decodes can grow for a while
    # without preempting the request just admitted.
    watermark_blocks: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.max_model_len, 2048))
        if self.max_num_seqs < 1:
            raise SchedulerConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # No chunked prefill yet: a whole prompt (or a preempted request's prompt + output)
        # must fit in one iteration.
        if self.max_num_batched_tokens < self.max_model_len:
            raise SchedulerConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}): prompts are prefilled in one iteration"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise SchedulerConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        capacity = self.num_blocks * self.block_size
        if capacity < self.max_model_len:
            raise SchedulerConfigError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of {self.block_size}), "
                f"fewer than max_model_len ({self.max_model_len}); give it more memory or lower max_model_len"
            )


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of an iteration: compute `num_new_tokens` tokens after the cached ones."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.all_token_ids[start:start + self.num_new_tokens]


@dataclass(frozen=True)
class Swap:
    """Move one request's KV between the pools: block `src[i]` of the source pool goes to
    block `dst[i]` of the other. The runner does all swaps before the iteration's forward."""

    request: Request
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class PlanMode:
    GPU_ONLY = "gpu_only"  # one batch, attention on the accelerator (the v0 forward)
    PIPELINED = "pipelined"  # Neo's asymmetric two-batch forward with CPU decoding attention


@dataclass
class IterationPlan:
    """What the runner executes this iteration.

    Batch-0 packs `prefills`, `decodes` (GPU-requests) and `cpu_decodes` (CPU-requests) in that
    order; batch-1 (`cpu_decodes1`) holds CPU-requests only. A prefill's KV goes to the pool of
    its request's `tier` (CPU: copied out layer by layer). Sampled tokens come back in
    `scheduled` order.
    """

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    cpu_decodes: list[ScheduledSeq] = field(default_factory=list)
    cpu_decodes1: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[Swap] = field(default_factory=list)  # GPU pool -> CPU pool
    swap_in: list[Swap] = field(default_factory=list)  # CPU pool -> GPU pool
    mode: str = PlanMode.GPU_ONLY
    estimated_time: float | None = None  # seconds, from the cost model when there is one
    # CPU-requests placed although a pipelining inequality breaks: they had waited too long, or
    # nothing else could run (Neo scheduler's bounded wait); their entries stay in the batches.
    forced: list[Request] = field(default_factory=list)

    @property
    def batch0(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes + self.cpu_decodes

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.batch0 + self.cpu_decodes1

    @property
    def num_batched_tokens(self) -> int:
        return (sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)
                + len(self.cpu_decodes) + len(self.cpu_decodes1))

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.cpu_decodes or self.cpu_decodes1)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.num_tokens > self.config.max_model_len:
            raise SchedulerConfigError(
                f"request {request.request_id} has {request.num_tokens} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests as aborted and free their blocks; unknown ids are ignored.
        One pass over the queues, however many requests go."""
        wanted = set(request_ids)
        aborted = [r for r in (*self.waiting, *self.running) if r.request_id in wanted]
        if aborted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in wanted)
            self.running = [r for r in self.running if r.request_id not in wanted]
            for request in aborted:
                self._release(request, RequestStatus.FINISHED_ABORTED)
        return aborted

    def finish_request(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request (also used by the engine for stop strings); frees its blocks."""
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request, status, stop_reason)

    def _pool_of(self, request: Request) -> BlockPool:
        """The pool holding `request`'s blocks (one pool here; the Neo scheduler has two)."""
        return self.block_pool

    def _queue_of(self, request: Request) -> list[Request]:
        """The runqueue a running `request` sits in (one here; the Neo scheduler has two)."""
        return self.running

    def _release(self, request: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        self._pool_of(request).free(request.block_ids)
        request.block_ids = []
        request.status = status
        request.stop_reason = stop_reason

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> IterationPlan:
        plan = IterationPlan()
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens

        # 1. Decodes, oldest first; the newest running request yields its blocks when short.
        index = 0
        while index < len(self.running):
            request = self.running[index]
            if not self._grow(request, request.num_tokens, plan):
                break  # `request` was itself the newest and got preempted
            plan.decodes.append(ScheduledSeq(request, request.num_computed_tokens, 1))
            token_budget -= 1
            index += 1

        # 2. Prefills, first come first served; none in an iteration that had to preempt.
        while self.waiting and not plan.preempted and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if num_new_tokens > token_budget:
                break
            num_blocks = blocks_for(request.num_tokens, cfg.block_size) - len(request.block_ids)
            reserve = cfg.watermark_blocks if self.running else 0
            if not self.block_pool.can_allocate(num_blocks + reserve):
                break
            request.block_ids.extend(self.block_pool.allocate(num_blocks))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.prefills.append(ScheduledSeq(request, request.num_computed_tokens, num_new_tokens))
            token_budget -= num_new_tokens
        return plan

    def _grow(self, request: Request, num_tokens: int, plan: IterationPlan) -> bool:
        """Give `request` blocks for `num_tokens` tokens, preempting the newest running
        requests as needed. False if `request` itself had to be preempted."""
        needed = blocks_for(num_tokens, self.config.block_size) - len(request.block_ids)
        while needed > 0 and not self.block_pool.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        if needed > 0:
            request.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def _preempt(self, request: Request) -> None:
        self._queue_of(request).remove(request)
        self._pool_of(request).free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0  # recompute prompt + generated tokens later
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ---- results --------------------------------------------------------------------------
    def update(self, plan: IterationPlan, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Append each scheduled request's sampled token, finish those that are done and free
        their blocks. Returns the requests that received a token, in plan order."""
        updated = []
        for seq, token_id in zip(plan.scheduled, sampled_token_ids):
            request = seq.request
            if request.finished:  # aborted while the iteration ran
                continue
            request.num_computed_tokens = seq.num_computed_tokens + seq.num_new_tokens
            request.output_token_ids.append(int(token_id))
            self._check_stop(request)
            updated.append(request)
        return updated

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return self.finish_request(request, RequestStatus.FINISHED_STOPPED)
            if token_id in params.stop_token_ids:
                return self.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason=token_id)
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or \
                request.num_tokens >= self.config.max_model_len:
            self.finish_request(request, RequestStatus.FINISHED_LENGTH)
