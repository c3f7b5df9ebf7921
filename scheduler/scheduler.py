"""The GPU-only scheduler: prefill waitqueue + decode runqueue, one mixed batch per iteration.

The engine runs it when there is no host KV pool; `NeoScheduler` (scheduler/neo.py) extends it
with the CPU tier.

Each iteration every running sequence decodes one token and waiting ones are admitted as
prefills while `max_num_seqs`, `max_num_batched_tokens` and the block pool allow (Orca's
selective batching: prefills and decodes share the linear layers of one forward). When a
running sequence needs a block and none is free, the newest running one is preempted:
its blocks are freed and it goes back to the front of the waitqueue, to be recomputed from
its prompt plus the tokens it already generated. Nothing is lost.

The scheduler only moves plain Python objects; the runner executes the plan it returns.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from scheduler.block_pool import BlockPool, blocks_for
from scheduler.sequence import Sequence, SequenceStatus, stop_check


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
    # without preempting the sequence just admitted.
    watermark_blocks: int = 1

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", max(self.max_model_len, 2048))
        if self.max_num_seqs < 1:
            raise SchedulerConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        # No chunked prefill yet: a whole prompt (or a preempted sequence's prompt + output)
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
    """One sequence's share of an iteration: compute `num_new_tokens` tokens after the cached ones."""

    sequence: Sequence
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.sequence.all_token_ids[start:start + self.num_new_tokens]


@dataclass(frozen=True)
class Swap:
    """Move one sequence's KV between the pools: block `src[i]` of the source pool goes to
    block `dst[i]` of the other. The runner does all swaps before the iteration's forward."""

    sequence: Sequence
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class PlanMode(str, Enum):
    """How the runner executes an iteration; the value is the `mode` label of the metrics."""

    GPU_ONLY = "gpu_only"  # one batch, attention on the GPU (layer by layer)
    PIPELINED = "pipelined"  # Neo's asymmetric two-batch forward with CPU decoding attention

    def __str__(self) -> str:
        return self.value


PLAN_MODES = tuple(PlanMode)  # every mode, for whoever counts by mode


@dataclass
class IterationPlan:
    """What the runner executes this iteration.

    Batch-0 packs `prefills`, `decodes` (GPU-sequences) and `batch0_cpu_decodes` (CPU-sequences) in that
    order; batch-1 (`batch1_cpu_decodes`) holds CPU-sequences only. A prefill's KV goes to the pool of
    its sequence's `tier` (CPU: copied out layer by layer). Sampled tokens come back in
    `scheduled` order.
    """

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    batch0_cpu_decodes: list[ScheduledSeq] = field(default_factory=list)
    batch1_cpu_decodes: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[Swap] = field(default_factory=list)  # GPU pool -> CPU pool
    swap_in: list[Swap] = field(default_factory=list)  # CPU pool -> GPU pool
    mode: PlanMode = PlanMode.GPU_ONLY
    estimated_time: float | None = None  # seconds, from the cost model when there is one
    # CPU-sequences placed although a pipelining inequality breaks: they had waited too long, or
    # nothing else could run (Neo scheduler's bounded wait); their entries stay in the batches.
    forced: list[Sequence] = field(default_factory=list)

    @property
    def batch0(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes + self.batch0_cpu_decodes

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.batch0 + self.batch1_cpu_decodes

    @property
    def num_batched_tokens(self) -> int:
        return (sum(s.num_new_tokens for s in self.prefills) + len(self.decodes)
                + len(self.batch0_cpu_decodes) + len(self.batch1_cpu_decodes))

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.batch0_cpu_decodes or self.batch1_cpu_decodes)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------
    def add_sequence(self, seq: Sequence) -> None:
        if seq.num_tokens > self.config.max_model_len:
            raise SchedulerConfigError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort_sequences(self, seq_ids: Iterable[str]) -> list[Sequence]:
        """Finish the given sequences as aborted and free their blocks; unknown ids are ignored.
        One pass over the queues, however many sequences go."""
        wanted = set(seq_ids)
        aborted = [r for r in (*self.waiting, *self.running) if r.seq_id in wanted]
        if aborted:
            self.waiting = deque(r for r in self.waiting if r.seq_id not in wanted)
            self.running = [r for r in self.running if r.seq_id not in wanted]
            for seq in aborted:
                self._release(seq, SequenceStatus.FINISHED_ABORTED)
        return aborted

    def finish_sequence(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End a sequence and free its blocks."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq, status, stop_reason)

    def _pool_of(self, seq: Sequence) -> BlockPool:
        """The pool holding `seq`'s blocks (one pool here; the Neo scheduler has two)."""
        return self.block_pool

    def _queue_of(self, seq: Sequence) -> list[Sequence]:
        """The runqueue a running `seq` sits in (one here; the Neo scheduler has two)."""
        return self.running

    def _release(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        self._pool_of(seq).free(seq.block_ids)
        seq.block_ids = []
        seq.status = status
        seq.stop_reason = stop_reason

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_sequences(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> IterationPlan:
        plan = IterationPlan()
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens

        # 1. Decodes, oldest first; the newest running sequence yields its blocks when short.
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            if not self._grow(seq, seq.num_tokens, plan):
                break  # `seq` was itself the newest and got preempted
            plan.decodes.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
            token_budget -= 1
            index += 1

        # 2. Prefills, first come first served; none in an iteration that had to preempt.
        while self.waiting and not plan.preempted and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            num_new_tokens = seq.num_tokens - seq.num_computed_tokens
            if num_new_tokens > token_budget:
                break
            num_blocks = blocks_for(seq.num_tokens, cfg.block_size) - len(seq.block_ids)
            reserve = cfg.watermark_blocks if self.running else 0
            if not self.block_pool.can_allocate(num_blocks + reserve):
                break
            seq.block_ids.extend(self.block_pool.allocate(num_blocks))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.prefills.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new_tokens))
            token_budget -= num_new_tokens
        return plan

    def _grow(self, seq: Sequence, num_tokens: int, plan: IterationPlan) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, preempting the newest running
        sequences as needed. False if `seq` itself had to be preempted."""
        needed = blocks_for(num_tokens, self.config.block_size) - len(seq.block_ids)
        while needed > 0 and not self.block_pool.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._queue_of(seq).remove(seq)
        self._pool_of(seq).free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0  # recompute prompt + generated tokens later
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results --------------------------------------------------------------------------
    def update(self, plan: IterationPlan, sampled_token_ids: list[int],
               logprobs: list[Any] | None = None) -> list[Sequence]:
        """Append each scheduled sequence's sampled token (and its logprobs entry, row for row),
        finish those that are done (`stop_check`) and free their blocks. Returns the sequences
        that received a token, in plan order."""
        updated = []
        for row, (scheduled, token_id) in enumerate(zip(plan.scheduled, sampled_token_ids)):
            seq = scheduled.sequence
            if seq.finished:  # aborted while the iteration ran
                continue
            seq.num_computed_tokens = scheduled.num_computed_tokens + scheduled.num_new_tokens
            if seq.sampling_params.max_tokens == 0:  # a prompt scored, nothing to generate
                self.finish_sequence(seq, SequenceStatus.FINISHED_LENGTH)
                updated.append(seq)
                continue
            seq.append_token(int(token_id), None if logprobs is None else logprobs[row])
            stop = stop_check(seq, self.config.max_model_len)
            if stop is not None:
                self.finish_sequence(seq, *stop)
                if seq.text is not None:
                    seq.text.finish()
            updated.append(seq)
        return updated
