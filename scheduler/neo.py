"""Neo's load-aware scheduler (Neo 3.2): two KV tiers, three queues, two asymmetric sub-batches.

Queues: `waiting` (prefill waitqueue), `running` (GPU-sequences: KV in the GPU pool,
`block_pool`) and `cpu_running` (CPU-sequences: KV in the host pool, `cpu_pool`, decoding
attention on the CPU). A prefilled sequence lives wholly in the pool its `tier` names.

A sequence's way between the queues:

    WAITING --prefill, the GPU pool holds it-----------------------------> GPU-sequence
    WAITING --prefill, only the host pool holds it-----------------------> CPU-sequence
                (step 5 may send it back to the front of the waitqueue within the iteration)
    GPU-sequence --swap out: the GPU cannot hold this iteration's new KV--> CPU-sequence
    CPU-sequence --swap in: room for the growth + reserve, cooldown over--> GPU-sequence
                (or at once, cooldown ignored, when it has waited too long)
    GPU-/CPU-sequence --preempt: neither pool can hold it---> WAITING (front; recomputed)
    any --finish / abort--> finished, blocks freed in its tier's pool

Each `schedule()` follows the paper's steps, one method each:
  1. two empty batches: batch-0 (prefills, GPU decodes, a few CPU decodes), batch-1 (CPU decodes);
  2. charge the new KV of every running sequence; swap out GPU-sequences (newest first) while the
     GPU cannot hold it, preempting when the host pool is full too; else swap CPU-sequences in
     (oldest first) while the GPU keeps free its sequences' growth over the cooldown window
     plus `swap_in_reserve_fraction` of its blocks;
  3. admit prefills first come first served, into the GPU pool, else the host pool while the CPU
     runqueue is not backed up (`cpu_admission_wait_fraction`), else stop;
  4. place CPU decodes (longest waiting first) into batch-1 while T_ca1 <= T_l0, else batch-0
     while T_ca0 <= T_l1 + T_ga0, else skip them this iteration (where MLPs are sliced, the CPU's
     share of the other sub-batch's linear stage, T_cl, joins each inequality's CPU side);
  5. drop CPU-bound prefills that only lengthen the GPU's side of the pipeline, unless the CPU
     has too little decode work without them (a deviation from the paper, see the method);
  6. compare the GPU-only plan (batch-0 less its CPU decodes) with the pipelined plan by
     estimated sequences per second and keep the better.

Hysteresis (no ping-pong): a swap-out fires only when the GPU cannot hold this iteration's new
KV, and takes the newest sequence outside its cooldown first; a swap-in only when, after it, the
GPU still holds every GPU-sequence's growth over the next `swap_cooldown_iterations` tokens plus
a reserve of free blocks, and never within the cooldown of the sequence's last move.

Bounded wait: a CPU-sequence skipped `max_cpu_wait_iterations` times in a row is swapped in
(cooldown ignored) or placed even if an inequality breaks (`IterationPlan.forced`), at most
`max_forced_cpu_decodes` of them per iteration, longest waiting first; every CPU-sequence is
placed when the GPU has nothing to run. With `num_cpu_blocks == 0` every step reduces to
the GPU-only `Scheduler` (scheduler/scheduler.py): same plans, same preemptions.

Blocks are reassigned at schedule time (allocate in the destination, free the source); the runner
performs the plan's copies (`IterationPlan.copies`: swaps, and the prefix cache's demotions and
promotions, scheduler/cache_tiers.py) in order before the iteration's forward, so freed GPU
blocks may be reused in the same plan; host blocks a copy reads stay pinned until the plan's
results come back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable

from scheduler.block_pool import BlockPool, blocks_for
from scheduler.cache_tiers import HostCacheTier, carry_hashes
from scheduler.planning.cost_model import CostModel
from scheduler.sequence import Sequence, SequenceStatus, Tier
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError
from scheduler.iteration_plan import BlockCopy, IterationPlan, PlanMode, ScheduledSeq, Swap


@dataclass(frozen=True)
class NeoKnobs:
    """The Neo scheduler's policy knobs on top of `SchedulerConfig`: what a user tunes, apart from
    the host pool's size, which the engine derives from memory (`NeoConfig` adds it). Validated
    once, at construction."""

    # Swap a CPU-sequence in only while this share of the GPU pool stays free after it. The gap
    # between this and the swap-out trigger (the GPU cannot hold this iteration's new KV) is the
    # hysteresis: a sequence swapped in has room to decode for a while before anyone goes out.
    # A tenth of the pool is several iterations of growth for a full batch of 16-token blocks.
    swap_in_reserve_fraction: float = 0.1
    # A sequence moved between the pools stays put this many iterations. A move copies the
    # sequence's whole KV once; staying put for 16 tokens amortizes that copy over 16 decodes.
    swap_cooldown_iterations: int = 16
    # A CPU-sequence skipped this many iterations in a row becomes overdue: it is swapped in or
    # placed whatever the cost model says (see max_forced_cpu_decodes), which bounds its wait.
    # Neo's own policy has no bound (a skipped request "waits for the next iteration"). Forcing
    # costs throughput whenever a decode step cannot hide even one sequence's attention (a fast
    # GPU beside a slow host): with 8 the simulated 2xH100 fell to 0.87x GPU-only. 64 iterations
    # is a couple of seconds at worst on a fast GPU, and rarely reached.
    max_cpu_wait_iterations: int = 64
    # At most this many overdue CPU-sequences are placed past the inequalities per iteration (the
    # longest waiting first). Forcing every overdue sequence at once stalls the GPU behind
    # the CPU for a whole iteration each time a crowd of them comes due together (the simulator
    # showed 0.65x GPU-only with 185 CPU-sequences); one per iteration keeps every sequence moving
    # (its wait is bounded by max_cpu_wait_iterations + the number overdue before it) at the cost
    # of one sequence's attention beyond what the linear work hides.
    max_forced_cpu_decodes: int = 1
    # Host blocks kept free when admitting a CPU-bound prefill, so CPU-sequences can grow for a
    # while without preempting the sequence just admitted (the GPU pool's `watermark_blocks`).
    cpu_watermark_blocks: int = 1
    # Backpressure on the CPU runqueue: a prefill goes into the host pool only while the
    # CPU-sequences, served at the rate CPU decodes were recently placed, would each wait at most
    # this share of `max_cpu_wait_iterations` between their decodes. Past that the pipeline
    # already holds more CPU work than the GPU's linear work hides, and a sequence admitted
    # on top only lengthens every wait until crowds come due and are forced (the simulated 2xH100
    # fell to 0.97x GPU-only with a runqueue of 241 served 4 per iteration). A quarter keeps
    # every simulated setup within 1% of its best; an eighth starves the runqueue's start-up.
    cpu_admission_wait_fraction: float = 0.25

    def __post_init__(self) -> None:
        _require_ints(self, (("swap_cooldown_iterations", 0), ("max_cpu_wait_iterations", 1),
                             ("cpu_watermark_blocks", 0), ("max_forced_cpu_decodes", 1)))
        for name, low_open in (("swap_in_reserve_fraction", False), ("cpu_admission_wait_fraction", True)):
            fraction = getattr(self, name)
            if (not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 <= fraction < 1
                    or (low_open and fraction == 0)):
                bounds = "(0, 1)" if low_open else "[0, 1)"
                raise SchedulerConfigError(f"{name} must be in {bounds}, got {fraction!r}")


@dataclass(frozen=True)
class NeoConfig(NeoKnobs):
    """What the Neo scheduler runs with: its knobs and the host pool's size."""

    # Blocks in the host (CPU) KV pool; 0 turns offloading off and the scheduler plans as the
    # GPU-only `Scheduler`.
    num_cpu_blocks: int = 0

    def __post_init__(self) -> None:
        _require_ints(self, (("num_cpu_blocks", 0),))
        super().__post_init__()

    @classmethod
    def from_knobs(cls, knobs: NeoKnobs, num_cpu_blocks: int) -> "NeoConfig":
        """`knobs` over a host pool of `num_cpu_blocks` blocks (a `NeoConfig`'s own pool size is dropped)."""
        return cls(num_cpu_blocks=num_cpu_blocks, **{f.name: getattr(knobs, f.name) for f in fields(NeoKnobs)})


def _require_ints(config: NeoKnobs, minimums: Iterable[tuple[str, int]]) -> None:
    for name, minimum in minimums:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise SchedulerConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def cpu_stage_time(cost: CostModel, num_seqs: int, context_tokens: int) -> float:
    """A CPU attention stage of one layer as the pipeline sees it (T_ca): the attention plus its
    hand-offs to and from the GPU; nothing when the stage is empty."""
    if num_seqs == 0:
        return 0.0
    return cost.cpu_decode_attention(num_seqs, context_tokens) + cost.handoff()


@dataclass
class _TwoBatches:
    """Running totals of one iteration's two sub-batches and their per-layer stage times."""

    cost: CostModel
    prefill_lens: list[int]  # parallel to plan.prefills
    num_gpu_decodes: int
    gpu_context_tokens: int
    num_batch0_cpu_decodes: int = 0
    batch0_cpu_context_tokens: int = 0
    num_batch1_cpu_decodes: int = 0
    batch1_cpu_context_tokens: int = 0

    @property
    def num_batch0_tokens(self) -> int:
        return sum(self.prefill_lens) + self.num_gpu_decodes + self.num_batch0_cpu_decodes

    def batch0_linear_time(self) -> float:  # T_l0
        return self.cost.linear(self.num_batch0_tokens)

    def batch1_linear_time(self) -> float:  # T_l1: batch-1 holds one token per CPU decode, on weights batch-0 brought
        return self.cost.linear_again(self.num_batch1_cpu_decodes)

    def batch0_cpu_linear_time(self) -> float:  # T_cl0: the CPU's share of batch-0's linear stage, beside T_ca1
        return self.cost.cpu_linear(self.num_batch0_tokens)

    def batch1_cpu_linear_time(self) -> float:  # T_cl1: the CPU's share of batch-1's, beside T_ca0
        return self.cost.cpu_linear(self.num_batch1_cpu_decodes)

    def batch0_gpu_attention_time(self) -> float:  # T_ga0: every prefill's attention runs on the GPU
        return (self.cost.prefill_attention(self.prefill_lens)
                + self.cost.gpu_decode_attention(self.num_gpu_decodes, self.gpu_context_tokens))

    def batch0_cpu_attention_time(self, num_more: int = 0, more_tokens: int = 0) -> float:  # T_ca0
        return cpu_stage_time(self.cost, self.num_batch0_cpu_decodes + num_more,
                              self.batch0_cpu_context_tokens + more_tokens)

    def batch1_cpu_attention_time(self, num_more: int = 0, more_tokens: int = 0) -> float:  # T_ca1
        return cpu_stage_time(self.cost, self.num_batch1_cpu_decodes + num_more,
                              self.batch1_cpu_context_tokens + more_tokens)

    def fits_batch1(self, context_tokens: int) -> bool:
        """T_cl0 + T_ca1 <= T_l0 with one more decode in batch-1 (which only lengthens T_l1, the other
        inequality's right side, and T_cl1 by a token's CPU slice). Batch-1 needs a batch-0 to hide under."""
        return (self.num_batch0_tokens > 0
                and self.batch0_cpu_linear_time() + self.batch1_cpu_attention_time(1, context_tokens)
                <= self.batch0_linear_time())

    def fits_batch0(self, context_tokens: int) -> bool:
        """T_cl1 + T_ca0 <= T_l1 + T_ga0 with one more decode in batch-0 (which lengthens T_l0 and
        T_cl0 by as much as the GPU's and the CPU's slices of one token take)."""
        return self.batch1_cpu_linear_time() + self.batch0_cpu_attention_time(1, context_tokens) <= self.batch1_linear_time() + self.batch0_gpu_attention_time()

    def add(self, batch: int, context_tokens: int) -> None:
        if batch == 0:
            self.num_batch0_cpu_decodes += 1
            self.batch0_cpu_context_tokens += context_tokens
        else:
            self.num_batch1_cpu_decodes += 1
            self.batch1_cpu_context_tokens += context_tokens

    def layer_time(self) -> float:
        """One layer of the pipelined plan: max(T_l0, T_cl0 + T_ca1) + max(T_l1 + T_ga0, T_cl1 + T_ca0).
        The CPU computes its share of each linear stage (T_cl, zero unless MLPs are sliced) in the
        same window as the other sub-batch's attention."""
        return (max(self.batch0_linear_time(), self.batch0_cpu_linear_time() + self.batch1_cpu_attention_time())
                + max(self.batch1_linear_time() + self.batch0_gpu_attention_time(),
                      self.batch1_cpu_linear_time() + self.batch0_cpu_attention_time()))

    def cheaper_batch_for(self, context_tokens: int) -> int:
        """The sub-batch whose layer time grows less with one more CPU decode. An empty batch-1
        costs a whole extra pass over the weights (its T_l1), so an overdue sequence usually goes
        into batch-0, where only the part of its attention the GPU cannot hide counts."""
        growth = []
        for batch in (0, 1):
            self.add(batch, context_tokens)
            growth.append(self.layer_time())
            self.remove(batch, context_tokens)
        return 0 if growth[0] <= growth[1] else 1

    def remove(self, batch: int, context_tokens: int) -> None:
        if batch == 0:
            self.num_batch0_cpu_decodes -= 1
            self.batch0_cpu_context_tokens -= context_tokens
        else:
            self.num_batch1_cpu_decodes -= 1
            self.batch1_cpu_context_tokens -= context_tokens

    def balanced(self) -> bool:
        """Both of Neo's inequalities: the CPU never works while the GPU idles."""
        return (self.batch0_cpu_linear_time() + self.batch1_cpu_attention_time() <= self.batch0_linear_time()
                and self.batch1_cpu_linear_time() + self.batch0_cpu_attention_time() <= self.batch1_linear_time()
                + self.batch0_gpu_attention_time())


def _rate(num_seqs: int, seconds: float) -> float:
    """Sequences per second; an iteration estimated at no time at all is infinitely fast."""
    if num_seqs == 0:
        return 0.0
    return num_seqs / seconds if seconds > 0 else math.inf


class NeoScheduler(Scheduler):
    """Plans Neo iterations over a GPU pool and a host pool; see the module docstring."""

    def __init__(self, config: SchedulerConfig, neo: NeoConfig, cost_model: CostModel) -> None:
        super().__init__(config)
        self.neo = neo
        self.cost_model = cost_model
        self.cpu_pool = BlockPool(neo.num_cpu_blocks, config.block_size)
        self.block_pool.records_evictions = True  # the host tier demotes them (finish_plan)
        self.host_tier = HostCacheTier(self.prefix_cache, self.block_pool, self.cpu_pool)
        self._admitted: list[Sequence] = []  # admitted in this iteration's step 3
        self.cpu_running: list[Sequence] = []  # in the order they became CPU-sequences: the last is the newest
        self.iteration = 0
        self._reserve_blocks = math.ceil(neo.swap_in_reserve_fraction * config.num_blocks)
        # cumulative counters and the last iteration's estimates, for the engine's metrics
        self.num_swap_out = 0
        self.num_swap_out_blocks = 0
        self.num_swap_in = 0
        self.num_swap_in_blocks = 0
        self.num_cpu_prefills = 0
        self.last_gpu_only_throughput = 0.0  # seqs/s
        self.last_pipelined_throughput = 0.0  # seqs/s, the two-batch plan
        self.last_one_batch_throughput = 0.0  # seqs/s, 0 when there was no such candidate
        # CPU decodes placed per iteration, averaged over about the last `max_cpu_wait_iterations`
        # iterations that had CPU-sequences to place: the runqueue's service rate, for backpressure.
        # An exponential average with its start-up bias divided out (`_service_weight`).
        self._service_average = 0.0
        self._service_weight = 0.0

    # ---- queues across both tiers ---------------------------------------------------------
    @property
    def num_gpu_running(self) -> int:
        return len(self.running)

    @property
    def num_cpu_running(self) -> int:
        return len(self.cpu_running)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.cpu_running) + len(self.prefilling)

    def has_unfinished_sequences(self) -> bool:
        return super().has_unfinished_sequences() or bool(self.cpu_running)

    def abort_sequences(self, seq_ids: Iterable[str]) -> list[Sequence]:
        wanted = set(seq_ids)
        aborted = super().abort_sequences(wanted)
        on_cpu = [r for r in self.cpu_running if r.seq_id in wanted]
        if on_cpu:
            self.cpu_running = [r for r in self.cpu_running if r.seq_id not in wanted]
            for seq in on_cpu:
                self._release(seq, SequenceStatus.FINISHED_ABORTED)
        return aborted + on_cpu

    def finish_sequence(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        if not seq.finished and seq.tier is Tier.CPU and seq in self.cpu_running:
            self.cpu_running.remove(seq)
        super().finish_sequence(seq, status, stop_reason)

    def _pool_of(self, seq: Sequence) -> BlockPool:
        return self.cpu_pool if seq.tier is Tier.CPU else self.block_pool

    def _queue_of(self, seq: Sequence) -> list[Sequence]:
        return self.cpu_running if seq.tier is Tier.CPU else self.running

    def _preempt(self, seq: Sequence) -> None:
        super()._preempt(seq)
        seq.tier = Tier.GPU  # no blocks anywhere; the next prefill picks its pool again
        seq.cpu_wait_iterations = 0

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> IterationPlan:
        self.iteration += 1
        self.host_tier.release_pins()  # normally done in update(); a failed forward never got there
        plan = IterationPlan()  # step 1
        self._charge_cpu_decodes(plan)  # step 2
        if not self._schedule_gpu_decodes(plan):
            self._swap_in(plan)
        self._schedule_prefills(plan)  # step 3
        batches = self._place_cpu_decodes(plan)  # step 4
        self._drop_cpu_prefills(plan, batches)  # step 5
        self._choose_plan(plan, batches)  # step 6
        scheduled = {id(scheduled.sequence) for scheduled in plan.scheduled}
        for seq in self.cpu_running:
            seq.cpu_wait_iterations = 0 if id(seq) in scheduled else seq.cpu_wait_iterations + 1
        if self._decoding_cpu_requests(plan):
            smoothing = 1 / self.neo.max_cpu_wait_iterations
            num_placed = len(plan.batch0_cpu_decodes) + len(plan.batch1_cpu_decodes)
            self._service_average += smoothing * (num_placed - self._service_average)
            self._service_weight += smoothing * (1 - self._service_weight)
        self.num_cpu_prefills += sum(1 for scheduled in plan.prefills
                                     if scheduled.sequence.tier is Tier.CPU and scheduled.samples)
        self.host_tier.finish_plan(plan)
        return plan

    def update(self, plan: IterationPlan, sampled_token_ids: list[int], logprobs=None,
               on_error=None) -> list[Sequence]:
        self.host_tier.release_pins()  # the plan's copies ran before its forward
        return super().update(plan, sampled_token_ids, logprobs, on_error)

    def _decoding_cpu_requests(self, plan: IterationPlan) -> list[Sequence]:
        """The CPU-sequences that have a token to decode: all but those `plan` prefills now."""
        just_prefilled = {id(scheduled.sequence) for scheduled in plan.prefills}
        return [r for r in self.cpu_running if id(r) not in just_prefilled]

    def _num_new_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` still needs for KV of all its tokens (the one decoded now included)."""
        return blocks_for(seq.num_tokens, self.config.block_size) - len(seq.block_ids)

    def _in_cooldown(self, seq: Sequence) -> bool:
        return self.iteration - seq.last_swap_iteration < self.neo.swap_cooldown_iterations

    def _charge_cpu_decodes(self, plan: IterationPlan) -> None:
        """Step 2, host side: every CPU-sequence gets the block its next token needs, whether it
        decodes this iteration or later; when the host pool is full the newest CPU-sequence is
        preempted (the GPU-only scheduler's rule). Done first so swap-outs only take host blocks
        that are spare."""
        for seq in list(self.cpu_running):  # oldest first
            needed = self._num_new_blocks(seq)
            while seq.status is SequenceStatus.RUNNING and not self.cpu_pool.can_allocate(needed):
                victim = self._newest_prefilling(Tier.CPU) or self.cpu_running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
            if seq.status is not SequenceStatus.RUNNING:
                break  # it went itself, after every newer one
            seq.block_ids.extend(self.cpu_pool.allocate(needed))

    def _schedule_gpu_decodes(self, plan: IterationPlan) -> bool:
        """Step 2, GPU side: every GPU-sequence decodes in batch-0. While the GPU pool cannot
        hold their new KV, the newest GPU-sequence outside its cooldown (else the newest) moves to
        the host pool, or, when the host pool cannot hold it either, the newest is preempted. The
        sequences that go are the fewest from the newest end, as the GPU-only scheduler preempts
        them. Returns whether the GPU was short of blocks."""
        needed = sum(self._num_new_blocks(r) for r in self.running)
        short = needed > self.block_pool.num_free_blocks
        while needed > self.block_pool.num_free_blocks and self._newest_prefilling(Tier.GPU):
            victim = self._newest_prefilling(Tier.GPU)  # a prefill in progress yields first
            self._preempt(victim)
            plan.preempted.append(victim)
        while needed > self.block_pool.num_free_blocks:
            victim = next((r for r in reversed(self.running) if not self._in_cooldown(r)), self.running[-1])
            swappable = self.cpu_pool.can_allocate(blocks_for(victim.num_tokens, self.config.block_size))
            if not swappable:
                victim = self.running[-1]
            needed -= self._num_new_blocks(victim)
            if swappable:
                self._swap_out(victim, plan)
            else:
                self._preempt(victim)
                plan.preempted.append(victim)
        for seq in self.running:
            seq.block_ids.extend(self.block_pool.allocate(self._num_new_blocks(seq)))
            plan.decodes.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
        return short

    def _newest_prefilling(self, tier: Tier) -> Sequence | None:
        """The newest prefill in progress into `tier`'s pool, if any: the first to yield blocks there."""
        return next((seq for seq in reversed(self.prefilling) if seq.tier is tier), None)

    def _swap_out(self, seq: Sequence, plan: IterationPlan) -> None:
        source = seq.block_ids
        destination = self.cpu_pool.allocate(len(source))
        growth = self.cpu_pool.allocate(blocks_for(seq.num_tokens, self.config.block_size) - len(source))
        carry_hashes(self.block_pool, source, self.cpu_pool, destination)
        self.block_pool.free(reversed(source))
        self.running.remove(seq)
        seq.block_ids = destination + growth
        seq.tier = Tier.CPU
        self._mark_moved(seq)
        self.cpu_running.append(seq)  # may decode on the CPU this very iteration (step 4)
        plan.swap_out.append(Swap(seq, tuple(source), tuple(destination)))
        plan.copies.append(BlockCopy(tuple(source), tuple(destination), to_cpu=True))
        self.num_swap_out += 1
        self.num_swap_out_blocks += len(source)

    def _swap_in(self, plan: IterationPlan) -> None:
        """Step 2, maximizing the GPU: move CPU-sequences in, oldest first and outside their
        cooldown, while the GPU keeps free, after each: the blocks every GPU-sequence will grow
        into during the cooldown window (so the newcomer is not pushed out again before the
        window ends), the reserve share and the watermark. A sequence that waited too long comes
        in first whenever its blocks fit, cooldown or not. Not called when the GPU was short of
        blocks this iteration (nothing comes in right after a GPU-sequence went out or was
        preempted)."""
        if not self.cpu_running:
            return
        watermark = self.config.watermark_blocks
        for seq in [r for r in self.cpu_running if r.cpu_wait_iterations >= self.neo.max_cpu_wait_iterations]:
            if self.block_pool.can_allocate(len(seq.block_ids) + watermark):
                self._move_in(seq, plan)
        growth = sum(self._growth_in_cooldown(r) for r in self.running)
        for seq in list(self.cpu_running):
            if self._in_cooldown(seq):
                continue
            needed = len(seq.block_ids) + self._growth_in_cooldown(seq)
            if not self.block_pool.can_allocate(needed + growth + self._reserve_blocks + watermark):
                break  # oldest first: later ones wait behind it
            growth += self._growth_in_cooldown(seq)
            self._move_in(seq, plan)

    def _growth_in_cooldown(self, seq: Sequence) -> int:
        """Blocks `seq` will add over the next `swap_cooldown_iterations` tokens, at most up to
        its `max_tokens` or the context length."""
        remaining = self.config.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        if max_tokens is not None:
            remaining = min(remaining, max_tokens - seq.num_output_tokens)
        horizon = min(self.neo.swap_cooldown_iterations, max(remaining, 0))
        block_size = self.config.block_size
        return blocks_for(seq.num_tokens + horizon, block_size) - blocks_for(seq.num_tokens, block_size)

    def _move_in(self, seq: Sequence, plan: IterationPlan) -> None:
        source = seq.block_ids  # its next token's block included (charged in step 2)
        destination = self.block_pool.allocate(len(source))
        carry_hashes(self.cpu_pool, source, self.block_pool, destination)
        self.host_tier.pin(source)  # read by this plan's copy: no other copy may write them
        self.cpu_pool.free(reversed(source))
        self.cpu_running.remove(seq)
        seq.block_ids = destination
        seq.tier = Tier.GPU
        self._mark_moved(seq)
        self.running.append(seq)
        plan.swap_in.append(Swap(seq, tuple(source), tuple(destination)))
        plan.copies.append(BlockCopy(tuple(source), tuple(destination), to_cpu=False))
        plan.decodes.append(ScheduledSeq(seq, seq.num_computed_tokens, 1))
        self.num_swap_in += 1
        self.num_swap_in_blocks += len(source)

    def _mark_moved(self, seq: Sequence) -> None:
        seq.num_swaps += 1
        seq.last_swap_iteration = self.iteration
        seq.cpu_wait_iterations = 0

    @property
    def cpu_service_rate(self) -> float | None:
        """CPU decodes placed per iteration lately; None before any iteration had one to place."""
        return self._service_average / self._service_weight if self._service_weight else None

    @property
    def max_cpu_admitted(self) -> float:
        """CPU-sequences beyond which no prefill enters the host pool (`cpu_admission_wait_fraction`):
        unbounded until the service rate is known, then at least one, so an idle runqueue restarts."""
        rate = self.cpu_service_rate
        if rate is None:
            return math.inf
        return max(1.0, rate * self.neo.cpu_admission_wait_fraction * self.neo.max_cpu_wait_iterations)

    def _schedule_prefills(self, plan: IterationPlan) -> None:
        """Step 3: the next chunk of each prefill in progress (into the pool its admission chose),
        then admissions, first come first served, into batch-0 while the token budget and
        `max_num_seqs` (sequences of both tiers, as the GPU-only scheduler counts them) allow. A
        sequence goes to the GPU pool if it holds the whole prompt, else to the host pool (the
        runner copies its KV out layer by layer) while fewer than `max_cpu_admitted`
        CPU-sequences run, else admission stops. No admission in an iteration that had to preempt
        (the GPU-only scheduler's rule)."""
        num_decoding = len(self.running) + len(self.cpu_running)
        token_budget = self._continue_prefills(plan, self._prefill_budget(plan, num_decoding))
        self._admitted = []
        if plan.preempted:
            return
        for seq in list(self.waiting):
            if token_budget <= 0 or self.num_running >= self.config.max_num_seqs:
                break
            if self._waits_for_sibling(seq, plan):
                continue
            if not (self._admit_to_gpu(seq, plan) or self._admit_to_host(seq)):
                break
            self._admitted.append(seq)
            token_budget -= self._start_prefill(seq, plan, token_budget)

    def _admit_to_gpu(self, seq: Sequence, plan: IterationPlan) -> bool:
        """Admit `seq` into the GPU pool if it holds the whole prompt (its watermark kept): the
        prefix cached there is shared, and the host pool's cached continuation of it promoted
        when copying beats computing it."""
        block_size = self.config.block_size
        gpu_hits = self.prefix_cache.match(seq, self.block_pool)
        host_hits = self.prefix_cache.match(seq, self.cpu_pool, skip_blocks=len(gpu_hits))
        reserve = self.config.watermark_blocks if self.running else 0
        if not self._take_blocks(seq, self.block_pool, gpu_hits, reserve, "gpu"):
            return False
        seq.tier = Tier.GPU
        if host_hits and self._promotion_pays(len(host_hits)):
            promoted = seq.block_ids[len(gpu_hits):len(gpu_hits) + len(host_hits)]
            self.host_tier.promote(host_hits, promoted, plan)
            seq.num_committed_blocks += len(host_hits)
            seq.num_computed_tokens += len(host_hits) * block_size
            self.prefix_cache.record("cpu", seq.num_tokens - len(gpu_hits) * block_size, len(host_hits) * block_size)
        return True

    def _admit_to_host(self, seq: Sequence) -> bool:
        """Admit `seq` into the host pool, a CPU-sequence from birth, while the CPU runqueue is not
        backed up and the pool holds the whole prompt: the prefix cached there is decoded from
        where it is."""
        num_cpu_seqs = len(self.cpu_running) + sum(1 for r in self.prefilling if r.tier is Tier.CPU)
        if num_cpu_seqs >= self.max_cpu_admitted:
            return False
        hits = self.prefix_cache.match(seq, self.cpu_pool)
        reserve = self.neo.cpu_watermark_blocks if self.cpu_running else 0
        if not self._take_blocks(seq, self.cpu_pool, hits, reserve, "cpu"):
            return False
        seq.tier = Tier.CPU
        return True

    def _promotion_pays(self, num_blocks: int) -> bool:
        """Copying `num_blocks` cached host blocks into the GPU pool beats computing their tokens
        again: the cost model's swap time against every layer's linear work on those tokens."""
        cost = self.cost_model
        return cost.swap(num_blocks) < cost.num_layers * cost.linear(num_blocks * self.config.block_size)

    def _new_batches(self, plan: IterationPlan) -> _TwoBatches:
        return _TwoBatches(self.cost_model, [s.num_new_tokens for s in plan.prefills], len(plan.decodes),
                           sum(s.sequence.num_tokens for s in plan.decodes))

    def _place_cpu_decodes(self, plan: IterationPlan, use_batch1: bool = True) -> _TwoBatches:
        """Step 4: CPU-sequences, longest waiting first, go to batch-1 while T_ca1 <= T_l0, else to
        batch-0 while T_ca0 <= T_l1 + T_ga0, else wait. One that waited too long, or any when
        the GPU has nothing to run (the engine must progress), is placed regardless, in the batch
        whose layer time grows less, and recorded in `plan.forced`: at most `max_forced_cpu_decodes` of the
        overdue ones per iteration. With `use_batch1` false batch-1 stays empty (the one-batch
        candidate of step 6)."""
        batches = self._new_batches(plan)
        candidates = sorted(self._decoding_cpu_requests(plan),
                            key=lambda r: -r.cpu_wait_iterations)  # stable: ties keep queue order
        gpu_idle = not (plan.prefills or plan.decodes)
        for seq in candidates:
            context_tokens = seq.num_tokens  # its KV with the token decoded now
            scheduled = ScheduledSeq(seq, seq.num_computed_tokens, 1)
            batch0_has_room = batches.num_batch0_tokens < self.config.max_num_batched_tokens
            if use_batch1 and batches.fits_batch1(context_tokens):
                batch = 1
            elif batch0_has_room and batches.fits_batch0(context_tokens):
                batch = 0
            elif gpu_idle or (seq.cpu_wait_iterations >= self.neo.max_cpu_wait_iterations
                              and len(plan.forced) < self.neo.max_forced_cpu_decodes):
                if use_batch1:
                    batch = batches.cheaper_batch_for(context_tokens) if batch0_has_room else 1
                elif batch0_has_room:
                    batch = 0
                else:
                    continue
                plan.forced.append(seq)
            else:
                continue
            batches.add(batch, context_tokens)
            (plan.batch1_cpu_decodes if batch else plan.batch0_cpu_decodes).append(scheduled)
        return batches

    def _drop_cpu_prefills(self, plan: IterationPlan, batches: _TwoBatches) -> None:
        """Step 5: drop CPU-bound prefills from batch-0, newest first, while both inequalities
        still hold without them: they only lengthen the GPU's side of the pipeline.

        Deviation from the paper: a prefill is kept while the CPU runqueue holds too little decode
        work to fill the pipeline (T_ca of all CPU-sequences < T_l0 of the plan), since dropping
        it would keep the CPU from ever getting work; and nothing is dropped when no CPU decode
        was placed, as there is then no pipeline to balance. Dropped prefills go back to the
        front of the waitqueue in their order, their host blocks freed."""
        if not (plan.batch0_cpu_decodes or plan.batch1_cpu_decodes):
            return
        decoding = self._decoding_cpu_requests(plan)
        cpu_work = self.cost_model.cpu_decode_attention(len(decoding), sum(r.num_tokens for r in decoding))
        dropped: list[Sequence] = []
        admitted_now = {id(seq) for seq in self._admitted}
        for index in reversed(range(len(plan.prefills))):
            seq = plan.prefills[index].sequence
            if seq.tier is not Tier.CPU or id(seq) not in admitted_now:
                continue  # a prefill in progress keeps its chunks coming
            if cpu_work < batches.batch0_linear_time():
                break
            length = batches.prefill_lens.pop(index)
            if not batches.balanced():
                batches.prefill_lens.insert(index, length)
                break
            del plan.prefills[index]
            dropped.append(seq)
        for seq in dropped:  # newest first, each in front of the one after it
            self._undo_admission(seq)

    def _undo_admission(self, seq: Sequence) -> None:
        """Send a sequence admitted this iteration back to the front of the waitqueue, its blocks freed."""
        (self.prefilling if seq in self.prefilling else self.cpu_running).remove(seq)
        self.prefix_cache.record_admission("cpu", seq.num_tokens, seq.num_computed_tokens, sign=-1)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.tier = Tier.GPU
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _choose_plan(self, plan: IterationPlan, batches: _TwoBatches) -> None:
        """Step 6: estimate the GPU-only plan (batch-0 less its CPU decodes), the two-batch plan
        of steps 4-5 and a one-batch plan, and keep the one with the most sequences per second.
        Forced CPU decodes rule the GPU-only plan out; a GPU-only plan runs no CPU work at all.

        The one-batch plan is step 4 again with batch-1 kept empty: CPU decodes ride in batch-0
        while their attention hides under the GPU's attention (T_ca0 <= T_ga0, the first
        inequality with T_l1 = 0). Not in the paper, whose step 4 opens batch-1 for the first CPU
        decode: on a GPU whose linear work is weight-bound at small batches, batch-1's
        second pass over the weights costs more than a few CPU decodes earn, and the GPU-only
        plan then leaves those decodes waiting although batch-0 could carry them for free."""
        cost = self.cost_model
        swap_time = cost.swap(sum(len(s.src_blocks) for s in (*plan.swap_out, *plan.swap_in)))
        num_gpu_seqs = len(plan.prefills) + len(plan.decodes)
        gpu_only_time = (cost.num_layers * (cost.linear(batches.num_batch0_tokens - batches.num_batch0_cpu_decodes)
                                            + batches.batch0_gpu_attention_time())
                         + cost.head(num_gpu_seqs) + swap_time)

        def pipelined_time(candidate: IterationPlan, placed: _TwoBatches) -> float:
            num_seqs = num_gpu_seqs + len(candidate.batch0_cpu_decodes) + len(candidate.batch1_cpu_decodes)
            return cost.num_layers * placed.layer_time() + cost.head(num_seqs) + swap_time

        one = IterationPlan(prefills=plan.prefills, decodes=plan.decodes)
        one_batches = self._place_cpu_decodes(one, use_batch1=False) if plan.batch1_cpu_decodes else None
        two_time = pipelined_time(plan, batches)
        self.last_gpu_only_throughput = _rate(num_gpu_seqs, gpu_only_time)
        self.last_pipelined_throughput = _rate(len(plan.scheduled), two_time)
        self.last_one_batch_throughput = 0.0
        # the one-batch plan may replace the two-batch plan only if it runs its overdue sequences too
        one_places_overdue = {id(s.sequence) for s in one.batch0_cpu_decodes} >= {id(r) for r in plan.forced}
        if one_batches is not None and one.batch0_cpu_decodes and one_places_overdue:
            one_time = pipelined_time(one, one_batches)
            self.last_one_batch_throughput = _rate(len(one.scheduled), one_time)
            if self.last_one_batch_throughput > self.last_pipelined_throughput:
                plan.batch0_cpu_decodes, plan.batch1_cpu_decodes, plan.forced = one.batch0_cpu_decodes, [], one.forced
                two_time = one_time
        pipelined_throughput = max(self.last_pipelined_throughput, self.last_one_batch_throughput)
        overdue = bool(plan.forced)  # a forced (overdue) sequence runs: no GPU-only plan
        num_cpu_seqs = len(plan.batch0_cpu_decodes) + len(plan.batch1_cpu_decodes)
        if num_cpu_seqs and (overdue or pipelined_throughput > self.last_gpu_only_throughput):
            plan.mode = PlanMode.PIPELINED
            plan.estimated_time = two_time
        else:
            plan.mode = PlanMode.GPU_ONLY
            plan.estimated_time = gpu_only_time
            plan.batch0_cpu_decodes.clear()
            plan.batch1_cpu_decodes.clear()
