"""The GPU-only scheduler: waitqueue, prefills in progress and decode runqueue, one mixed batch
per iteration under a token budget.

The engine runs it when there is no host KV pool; `NeoScheduler` (scheduler/neo.py) extends it
with the CPU tier.

Each iteration spends `max_num_batched_tokens` (chunked prefill, as vLLM v1 schedules): every
running sequence decodes one token first, then the prefills in progress take their next chunk,
oldest first, then waiting sequences are admitted, first come first served, while
`max_num_seqs`, the budget and the block pool allow. There is no prefill phase: a sequence's
`num_computed_tokens` catches up with its tokens chunk by chunk, and only the chunk that reaches
its last token samples. Prefills and decodes share the linear layers of one forward (Orca's
selective batching).

Admission first looks the prompt up in the prefix cache (scheduler/prefix_cache.py): the full
blocks found are shared (reference-counted) and their tokens skipped. Samples of one request
(n > 1) after the first wait until its prompt is computed, then share its blocks.

When a running sequence needs a block and none is free, the newest prefill in progress, else the
newest running sequence, is preempted: its blocks are freed (their cached prefix stays findable)
and it goes back to the front of the waitqueue, to be recomputed from its prompt plus the tokens
it already generated. Nothing is lost.

The scheduler only moves plain Python objects; the runner executes the plan it returns.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from scheduler.block_pool import BlockPool, blocks_for
from scheduler.prefill_pacing import PrefillPacer
from scheduler.prefix_cache import PrefixCache
from scheduler.iteration_plan import IterationPlan, ScheduledSeq
from scheduler.sequence import Sequence, SequenceStatus, stop_check

# The token budget when none is given: vLLM's default for chunked prefill. The engine picks its
# own per device (engine/config.py) from measurements; this is for the scheduler used alone.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class SchedulerConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Blocks kept free when admitting a prefill, so running decodes can grow for a while
    # without preempting the sequence just admitted.
    watermark_blocks: int = 1
    enable_prefix_caching: bool = True
    # What besides the tokens makes K/V what it is (model, dtype, quantization): the root of
    # every block hash, so no two engines' blocks could ever be taken for each other.
    prefix_cache_key: str = ""
    # While sequences decode, an iteration carrying prefill chunks takes at most this many
    # decode-only iterations' time, and at most max_prefill_stall_s longer than one
    # (scheduler/prefill_pacing.py); 0: no such bound, both 0: the token budget alone.
    max_prefill_slowdown: float = 0.0
    max_prefill_stall_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if self.max_num_seqs < 1:
            raise SchedulerConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        slowdown = self.max_prefill_slowdown
        if (not isinstance(slowdown, (int, float)) or isinstance(slowdown, bool)
                or not (slowdown == 0 or slowdown > 1)):
            raise SchedulerConfigError(f"max_prefill_slowdown must be 0 (off) or > 1, got {slowdown!r}")
        stall = self.max_prefill_stall_s
        if not isinstance(stall, (int, float)) or isinstance(stall, bool) or not stall >= 0:
            raise SchedulerConfigError(f"max_prefill_stall_s must be 0 (off) or > 0, got {stall!r}")
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


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_pool = BlockPool(config.num_blocks, config.block_size)
        self.prefix_cache = PrefixCache(config.block_size, config.prefix_cache_key, config.enable_prefix_caching)
        self.pacer = PrefillPacer(config.max_prefill_slowdown, min_tokens=config.block_size,
                                  max_stall_s=config.max_prefill_stall_s)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not yet computed: the last is the newest
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
        aborted = [r for r in (*self.waiting, *self.prefilling, *self.running) if r.seq_id in wanted]
        if aborted:
            self.waiting = deque(r for r in self.waiting if r.seq_id not in wanted)
            self.prefilling = [r for r in self.prefilling if r.seq_id not in wanted]
            self.running = [r for r in self.running if r.seq_id not in wanted]
            for seq in aborted:
                self._release(seq, SequenceStatus.FINISHED_ABORTED)
        return aborted

    def finish_sequence(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """End a sequence and free its blocks."""
        if seq.finished:
            return
        for queue in (self.running, self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                break
        self._release(seq, status, stop_reason)

    def _pool_of(self, seq: Sequence) -> BlockPool:
        """The pool holding `seq`'s blocks (one pool here; the Neo scheduler has two)."""
        return self.block_pool

    def _queue_of(self, seq: Sequence) -> list[Sequence]:
        """The runqueue a decoding `seq` sits in (one here; the Neo scheduler has two)."""
        return self.running

    def _free_blocks(self, seq: Sequence) -> None:
        """Drop `seq`'s references to its blocks, tail first (scheduler/block_pool.py's order)."""
        self._pool_of(seq).free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_committed_blocks = 0

    def _release(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        self._free_blocks(seq)
        seq.status = status
        seq.stop_reason = stop_reason

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def has_unfinished_sequences(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> IterationPlan:
        plan = IterationPlan()
        # 1. Decodes, oldest first; the newest prefill in progress, else the newest running
        # sequence, yields its blocks when short.
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            if not self._grow(seq, seq.num_tokens, plan):
                break  # `seq` was itself the newest and got preempted
            plan.decodes.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
            index += 1
        # 2. The next chunk of each prefill in progress, oldest first.
        token_budget = self._continue_prefills(plan, self._prefill_budget(plan, len(self.running)))
        # 3. New prefills, first come first served; none in an iteration that had to preempt.
        if not plan.preempted:
            self._admit_prefills(plan, token_budget)
        return plan

    def _prefill_budget(self, plan: IterationPlan, num_decoding: int) -> int:
        """Prefill tokens this iteration may carry: the budget the decodes leave, capped by the
        pacer while `num_decoding` sequences decode."""
        budget = self.config.max_num_batched_tokens - len(plan.decodes)
        cap = self.pacer.max_prefill_tokens(num_decoding)
        return budget if cap is None else min(budget, cap)

    def observe_step(self, plan: IterationPlan, forward_s: float) -> None:
        """The measured time of `plan`'s forward, for the pacer."""
        num_prefill_tokens = sum(s.num_new_tokens for s in plan.prefills)
        self.pacer.observe(plan.num_batched_tokens - num_prefill_tokens, num_prefill_tokens, forward_s)

    def _continue_prefills(self, plan: IterationPlan, token_budget: int) -> int:
        """Schedule the next chunk of every prefill in progress while the budget and its pool
        allow; returns the budget left."""
        for seq in list(self.prefilling):
            if token_budget <= 0:
                break
            token_budget -= self._schedule_chunk(seq, plan, token_budget)
        return token_budget

    def _schedule_chunk(self, seq: Sequence, plan: IterationPlan, token_budget: int) -> int:
        """Schedule `seq`'s next chunk of at most `token_budget` tokens (its blocks were all taken at
        admission); a chunk reaching its last token moves it to its runqueue. Returns the tokens
        scheduled."""
        start = seq.num_computed_tokens
        num_new_tokens = min(seq.num_tokens - start, token_budget)
        final = start + num_new_tokens == seq.num_tokens
        plan.prefills.append(ScheduledSeq(seq, start, num_new_tokens, samples=final))
        if final:
            self.prefilling.remove(seq)
            self._queue_of(seq).append(seq)
        return num_new_tokens

    def _admit_prefills(self, plan: IterationPlan, token_budget: int) -> None:
        """Admit waiting sequences in order while `max_num_seqs`, the budget and the GPU pool
        allow; each takes its cached prefix, then its first chunk."""
        for seq in list(self.waiting):
            if token_budget <= 0 or self.num_running >= self.config.max_num_seqs:
                break
            if self._waits_for_sibling(seq, plan):
                continue
            hits = self.prefix_cache.match(seq, self.block_pool)
            reserve = self.config.watermark_blocks if self.running else 0
            if not self._take_blocks(seq, self.block_pool, hits, reserve, "gpu"):
                break
            token_budget -= self._start_prefill(seq, plan, token_budget)

    @staticmethod
    def _num_cached_free(pool: BlockPool, blocks: list[int]) -> int:
        """How many of `blocks` are free (cached): taking them leaves that many fewer to allocate."""
        return sum(1 for block in blocks if pool.ref_count(block) == 0)

    def _take_blocks(self, seq: Sequence, pool: BlockPool, hits: list[int], reserve: int, tier: str) -> bool:
        """Give `seq` its whole prompt's blocks in `pool` if it has them to spare beyond `reserve`:
        the cached blocks `hits` shared as the start of its table, the rest allocated (a chunked
        prefill's later chunks never wait for blocks). False, taking nothing, if short."""
        needed = blocks_for(seq.num_tokens, self.config.block_size) - len(hits)
        if not pool.can_allocate(needed + reserve + self._num_cached_free(pool, hits)):
            return False
        pool.touch(hits)
        seq.block_ids = [*hits, *pool.allocate(needed)]
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.config.block_size
        if seq.num_cached_prompt_tokens is None:  # a preempted sequence's readmission reuses its own blocks
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
        self.prefix_cache.record_admission(tier, seq.num_tokens, seq.num_computed_tokens)
        return True

    def _start_prefill(self, seq: Sequence, plan: IterationPlan, token_budget: int) -> int:
        """Move an admitted `seq` (its cached prefix taken) from the waitqueue to the prefills in
        progress and schedule its first chunk; returns the tokens scheduled."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.prefilling.append(seq)
        return self._schedule_chunk(seq, plan, token_budget)

    def _waits_for_sibling(self, seq: Sequence, plan: IterationPlan) -> bool:
        """Another sample of `seq`'s request is computing the same prompt: wait for its blocks
        rather than compute them again (only with prefix caching, for prompts of a full block)."""
        if not self.prefix_cache.cacheable_blocks(seq) or not seq.request_id:
            return False
        return any(other.request_id == seq.request_id and other is not seq
                   for other in (*self.prefilling, *(s.sequence for s in plan.prefills)))

    def _victim(self) -> Sequence:
        """Who yields its blocks: the newest prefill in progress, else the newest running sequence."""
        return self.prefilling[-1] if self.prefilling else self.running[-1]

    def _grow(self, seq: Sequence, num_tokens: int, plan: IterationPlan) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, preempting the newest sequences as needed
        (`_victim`). False if `seq` itself had to be preempted."""
        needed = blocks_for(num_tokens, self.config.block_size) - len(seq.block_ids)
        while needed > 0 and not self.block_pool.can_allocate(needed):
            victim = self._victim()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        if needed > 0:
            seq.block_ids.extend(self.block_pool.allocate(needed))
        return True

    def _preempt(self, seq: Sequence) -> None:
        (self.prefilling if seq in self.prefilling else self._queue_of(seq)).remove(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0  # recompute prompt + generated tokens later (cached blocks help)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ---- results --------------------------------------------------------------------------
    def update(self, plan: IterationPlan, sampled_token_ids: list[int], logprobs: list[Any] | None = None,
               on_error: Callable[[Sequence, Exception], None] | None = None) -> list[Sequence]:
        """Advance each scheduled sequence's computed tokens and make its full blocks findable;
        append each sampling sequence's token (and its logprobs entry; both lists follow
        `plan.sampling`), finish those that are done (`stop_check`) and free their blocks.
        Returns the sequences that received a token, in plan order. `on_error`: where taking a
        sequence's token raises (its detokenizer, its grammar), told so while the others go on;
        None: the error propagates."""
        updated = []
        sampled = iter(zip(sampled_token_ids, logprobs if logprobs is not None else [None] * len(sampled_token_ids)))
        for scheduled in plan.scheduled:
            token = next(sampled) if scheduled.samples else None
            if scheduled.sequence.finished or scheduled.is_verify:  # aborted while it ran; verified apart
                continue
            try:
                if self._take_token(scheduled, token):
                    updated.append(scheduled.sequence)
            except Exception as exc:  # noqa: BLE001 (reported per sequence)
                if on_error is None:
                    raise
                on_error(scheduled.sequence, exc)
        return updated

    # ---- speculative decoding --------------------------------------------------------------
    def reserve_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for `num_tokens` of `seq`'s tokens (its drafts' slots) from its pool, where they
        are free: drafts never preempt anyone. Extra blocks stay with it until it ends."""
        pool = self._pool_of(seq)
        needed = blocks_for(num_tokens, self.config.block_size) - len(seq.block_ids)
        if needed > 0 and not pool.can_allocate(needed):
            return False
        if needed > 0:
            seq.block_ids.extend(pool.allocate(needed))
        return True

    def take_verified(self, scheduled: ScheduledSeq, position: int, token: tuple[int, Any]) -> bool:
        """The token a verify share's row `position` gave (engine/speculative/verify.py): taken
        as a decode's, the positions before it computed. Whether its sequence goes on (not
        finished); the caller stops at the first token that differs from the draft."""
        decode = ScheduledSeq(scheduled.sequence, scheduled.num_computed_tokens + position, 1)
        self._take_token(decode, token)
        return not scheduled.sequence.finished

    def _take_token(self, scheduled: ScheduledSeq, token: tuple[int, Any] | None) -> bool:
        """One scheduled share's update; whether its sequence received a token."""
        seq = scheduled.sequence
        seq.num_computed_tokens = scheduled.num_computed_tokens + scheduled.num_new_tokens
        self.prefix_cache.commit(seq, self._pool_of(seq))
        if token is None:
            return False
        if seq.sampling_params.max_tokens == 0:  # a prompt scored, nothing to generate
            self.finish_sequence(seq, SequenceStatus.FINISHED_LENGTH)
            return True
        seq.append_token(int(token[0]), token[1])
        stop = stop_check(seq, self.config.max_model_len)
        if stop is not None:
            self.finish_sequence(seq, *stop)
            if seq.text is not None:
                seq.text.finish()
        return True
