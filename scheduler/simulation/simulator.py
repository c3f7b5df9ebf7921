"""Discrete-event simulator: the real Neo scheduler in simulated time.

Each step asks `NeoScheduler.schedule()` for a plan, advances the clock by the plan's time under a
cost model (a `RooflineCostModel` from a hardware profile, or any `CostModel`), and feeds fake
sampled tokens back through `update()`. Nothing else is simulated: admission, swaps, preemptions,
batch placement and the GPU-only/pipelined choice are the scheduler's own. The GPU-only baseline is
the same scheduler with an empty host pool (`num_cpu_blocks=0`), which plans exactly as the GPU-only
`Scheduler` does.

The clock advances by the iteration formulas of Neo 3.2, computed here from the plan alone:

    GPU-only:  L * (T_l(batch) + T_ga(batch)) + head + swap
    pipelined: L * (max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0)) + head + swap

The scheduler estimates the same formulas; `SimulationResult.num_estimate_mismatches` counts the
iterations where its `estimated_time` disagrees, so a drift between the two shows. A CPU-bound
prefill's KV is copied out layer by layer while the next layers compute (Neo 3.1), so that copy
costs no time here; swaps between the pools do. Workloads are Neo's synthetic ones (section 5.1):
input and output lengths drawn uniformly within +-10% of fixed values, all requests at once
(throughput) or Poisson arrivals. No torch here.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from scheduler.planning.cost_model import CostModel, ModelShape
from scheduler.neo import NeoConfig, NeoKnobs, NeoScheduler, cpu_stage_time
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence
from scheduler.simulation.roofline import HardwareProfile, RooflineCostModel, size_pools
from scheduler.scheduler import SchedulerConfig
from scheduler.iteration_plan import PLAN_MODES, IterationPlan, PlanMode, ScheduledSeq

# The token every simulated sampling returns; requests run to max_tokens (ignore_eos).
SAMPLED_TOKEN = 0
# Neo section 5.1: lengths uniform in [0.9 l, 1.1 l].
NEO_LENGTH_SPREAD = 0.1
# Relative slack when comparing this simulator's iteration time with the scheduler's estimate:
# both sum the same floats, possibly in another order.
ESTIMATE_TOLERANCE = 1e-9
# vLLM's default cap on running sequences; both tiers count against it.
DEFAULT_MAX_NUM_SEQS = 256
# The smallest per-iteration token budget, as `SchedulerConfig` defaults it: room for a 2048-token
# prompt or several shorter ones beside the decodes.
MIN_NUM_BATCHED_TOKENS = 2048


class SimulationError(RuntimeError):
    """The simulation cannot go on (the scheduler stalls with requests left)."""


# ---- workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Neo's synthetic workload: `num_requests` requests with input and output lengths drawn
    independently and uniformly from [(1 - spread) l, (1 + spread) l]; all arriving at time 0 when
    `request_rate` is None, else as a Poisson process of that many requests per second."""

    num_requests: int
    input_len: int
    output_len: int
    spread: float = NEO_LENGTH_SPREAD
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.spread, (int, float)) or not 0 <= self.spread < 1:
            raise ValueError(f"spread must be in [0, 1), got {self.spread!r}")
        if self.request_rate is not None and not (isinstance(self.request_rate, (int, float))
                                                  and math.isfinite(self.request_rate) and self.request_rate > 0):
            raise ValueError(f"request_rate must be a number > 0 or None, got {self.request_rate!r}")

    def _bounds(self, length: int) -> tuple[int, int]:
        return max(1, math.ceil((1 - self.spread) * length)), math.floor((1 + self.spread) * length)

    @property
    def max_input_len(self) -> int:
        return self._bounds(self.input_len)[1]

    @property
    def max_output_len(self) -> int:
        return self._bounds(self.output_len)[1]

    def sample(self) -> list[tuple[float, int, int]]:
        """(arrival time, input length, output length) of each request, in arrival order."""
        rng = random.Random(self.seed)
        arrival = 0.0
        requests = []
        for _ in range(self.num_requests):
            if self.request_rate is not None:
                arrival += rng.expovariate(self.request_rate)
            requests.append((arrival, rng.randint(*self._bounds(self.input_len)),
                             rng.randint(*self._bounds(self.output_len))))
        return requests


# ---- iteration time -----------------------------------------------------------------------------
def _context_tokens(seqs: list[ScheduledSeq]) -> int:
    """A decode reads the KV of all its tokens, the one it computes now included."""
    return sum(s.num_computed_tokens + s.num_new_tokens for s in seqs)


def iteration_time(plan: IterationPlan, cost: CostModel) -> float:
    """Seconds the runner takes for `plan` under `cost` (Neo 3.2's formulas, module docstring)."""
    prefill_lens = [s.num_new_tokens for s in plan.prefills]
    num_prefill_tokens = sum(prefill_lens)
    batch0_gpu_attention_time = (cost.prefill_attention(prefill_lens)
                      + cost.gpu_decode_attention(len(plan.decodes), _context_tokens(plan.decodes)))
    swap_time = cost.swap(sum(len(s.src_blocks) for s in (*plan.swap_out, *plan.swap_in)))
    num_gpu_seqs = len(plan.prefills) + len(plan.decodes)
    if plan.mode == PlanMode.GPU_ONLY:
        layer = cost.linear(num_prefill_tokens + len(plan.decodes)) + batch0_gpu_attention_time
        return cost.num_layers * layer + cost.head(num_gpu_seqs) + swap_time
    batch0_linear_time = cost.linear(num_prefill_tokens + len(plan.decodes) + len(plan.batch0_cpu_decodes))
    batch1_linear_time = cost.linear_again(len(plan.batch1_cpu_decodes))
    batch0_cpu_attention_time = cpu_stage_time(cost, len(plan.batch0_cpu_decodes),
                                               _context_tokens(plan.batch0_cpu_decodes))
    batch1_cpu_attention_time = cpu_stage_time(cost, len(plan.batch1_cpu_decodes),
                                               _context_tokens(plan.batch1_cpu_decodes))
    layer = max(batch0_linear_time, batch1_cpu_attention_time) + max(batch1_linear_time + batch0_gpu_attention_time,
                                                                     batch0_cpu_attention_time)
    return (cost.num_layers * layer
            + cost.head(num_gpu_seqs + len(plan.batch0_cpu_decodes) + len(plan.batch1_cpu_decodes))
            + swap_time)


# ---- results -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    arrival_time: float
    first_token_time: float
    finish_time: float
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def per_token_latency(self) -> float:
        """Neo's per-token latency: the whole request's latency over its output tokens."""
        return (self.finish_time - self.arrival_time) / self.num_output_tokens


@dataclass(frozen=True)
class SimulationResult:
    makespan_s: float  # from the first arrival to the last finish
    num_output_tokens: int
    records: tuple[RequestRecord, ...]  # in finishing order
    num_iterations: int
    iterations_by_mode: dict[str, int]
    num_swap_out: int
    num_swap_in: int
    num_swap_blocks: int
    num_preemptions: int
    num_cpu_prefills: int
    num_forced: int  # CPU decodes placed past an inequality (bounded wait, or nothing else to run)
    mean_gpu_batch: float  # prefills + GPU decodes per iteration
    mean_cpu_batch: float  # CPU decodes per iteration
    peak_gpu_requests: int  # most GPU-sequences at once (KV in the GPU pool)
    peak_cpu_requests: int  # most CPU-sequences at once (KV in the host pool)
    num_estimate_mismatches: int  # iterations where the scheduler's estimate differs from ours

    @property
    def output_throughput(self) -> float:
        """Output tokens per second."""
        return self.num_output_tokens / self.makespan_s if self.makespan_s > 0 else math.inf

    def per_token_latency(self, quantile: float) -> float:
        return percentile([r.per_token_latency for r in self.records], quantile)

    def summary(self) -> dict[str, object]:
        return {
            "output_throughput": self.output_throughput,
            "makespan_s": self.makespan_s,
            "num_output_tokens": self.num_output_tokens,
            "per_token_latency_p50_s": self.per_token_latency(0.5),
            "per_token_latency_p90_s": self.per_token_latency(0.9),
            "num_iterations": self.num_iterations,
            "iterations_by_mode": dict(self.iterations_by_mode),
            "num_swap_out": self.num_swap_out,
            "num_swap_in": self.num_swap_in,
            "num_swap_blocks": self.num_swap_blocks,
            "num_preemptions": self.num_preemptions,
            "num_cpu_prefills": self.num_cpu_prefills,
            "num_forced": self.num_forced,
            "mean_gpu_batch": self.mean_gpu_batch,
            "mean_cpu_batch": self.mean_cpu_batch,
            "peak_gpu_requests": self.peak_gpu_requests,
            "peak_cpu_requests": self.peak_cpu_requests,
            "num_estimate_mismatches": self.num_estimate_mismatches,
        }


def percentile(values: list[float], quantile: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = quantile * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- the loop ------------------------------------------------------------------------------------
def simulate(scheduler: NeoScheduler, workload: Workload, cost: CostModel | None = None) -> SimulationResult:
    """Run `workload` through `scheduler` to the end; the clock follows `cost` (by default the
    scheduler's own cost model)."""
    cost = cost or scheduler.cost_model
    pending = workload.sample()
    next_arrival = 0
    clock = 0.0
    first_token: dict[str, float] = {}
    records: list[RequestRecord] = []
    by_mode = dict.fromkeys(PLAN_MODES, 0)
    num_iterations = num_forced = num_gpu_seqs = num_cpu_seqs = num_mismatches = 0
    peak_gpu_requests = peak_cpu_requests = 0
    while next_arrival < len(pending) or scheduler.has_unfinished_sequences():
        while next_arrival < len(pending) and pending[next_arrival][0] <= clock:
            arrival, input_len, output_len = pending[next_arrival]
            scheduler.add_sequence(Sequence(
                str(next_arrival), [SAMPLED_TOKEN] * input_len,
                SamplingParams(max_tokens=output_len, ignore_eos=True), arrival_time=arrival))
            next_arrival += 1
        plan = scheduler.schedule() if scheduler.has_unfinished_sequences() else None
        if plan is None or plan.is_empty:
            if next_arrival == len(pending):
                raise SimulationError(f"the scheduler planned nothing at t={clock:.3f}s with "
                                      f"{scheduler.num_waiting} waiting and {scheduler.num_running} running")
            clock = max(clock, pending[next_arrival][0])  # idle until the next request comes
            continue
        seconds = iteration_time(plan, cost)
        if plan.estimated_time is not None and \
                abs(plan.estimated_time - seconds) > ESTIMATE_TOLERANCE * seconds:
            num_mismatches += 1
        clock += seconds
        num_iterations += 1
        by_mode[plan.mode] = by_mode.get(plan.mode, 0) + 1
        num_forced += len(plan.forced)
        num_gpu_seqs += len(plan.prefills) + len(plan.decodes)
        num_cpu_seqs += len(plan.batch0_cpu_decodes) + len(plan.batch1_cpu_decodes)
        peak_gpu_requests = max(peak_gpu_requests, scheduler.num_gpu_running)
        peak_cpu_requests = max(peak_cpu_requests, scheduler.num_cpu_running)
        for seq in scheduler.update(plan, [SAMPLED_TOKEN] * len(plan.sampling)):
            first_token.setdefault(seq.seq_id, clock)
            if seq.finished:
                records.append(RequestRecord(seq.seq_id, seq.arrival_time,
                                             first_token[seq.seq_id], clock,
                                             seq.num_prompt_tokens, seq.num_output_tokens))
    return SimulationResult(
        makespan_s=clock - (pending[0][0] if pending else 0.0),
        num_output_tokens=sum(r.num_output_tokens for r in records),
        records=tuple(records),
        num_iterations=num_iterations,
        iterations_by_mode=by_mode,
        num_swap_out=scheduler.num_swap_out,
        num_swap_in=scheduler.num_swap_in,
        num_swap_blocks=scheduler.num_swap_out_blocks + scheduler.num_swap_in_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_cpu_prefills=scheduler.num_cpu_prefills,
        num_forced=num_forced,
        mean_gpu_batch=num_gpu_seqs / max(num_iterations, 1),
        mean_cpu_batch=num_cpu_seqs / max(num_iterations, 1),
        peak_gpu_requests=peak_gpu_requests,
        peak_cpu_requests=peak_cpu_requests,
        num_estimate_mismatches=num_mismatches,
    )


# ---- one machine, one model ------------------------------------------------------------------------
@dataclass(frozen=True)
class SystemSetup:
    """What `build_scheduler` made for one machine and model, for reports."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


def build_scheduler(shape: ModelShape, hardware: HardwareProfile, workload: Workload, *, cpu_attention: bool,
                    dtype_bytes: int = 2, block_size: int = 16, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                    num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
                    neo: NeoKnobs | None = None,
                    kv_element_bytes: float | None = None) -> tuple[NeoScheduler, SystemSetup]:
    """A NeoScheduler over a `RooflineCostModel` with pools sized by `size_pools` (or the given
    block counts), long enough for the workload's longest request; `cpu_attention=False` empties the
    host pool for the GPU-only baseline. `neo` sets the scheduler's knobs (a `NeoConfig`'s
    `num_cpu_blocks` is replaced by the host pool's size). `kv_element_bytes`: the KV format's
    (scheduler/planning/kv_format.py; None: dtype_bytes): both pools hold more blocks, and attention reads fewer bytes."""
    max_model_len = workload.max_input_len + workload.max_output_len
    max_num_batched_tokens = max(max_model_len, MIN_NUM_BATCHED_TOKENS)
    pools = size_pools(shape, hardware, dtype_bytes=dtype_bytes, block_size=block_size,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       kv_element_bytes=kv_element_bytes)
    num_gpu = pools.num_gpu_blocks if num_gpu_blocks is None else num_gpu_blocks
    num_cpu = (pools.num_cpu_blocks if num_cpu_blocks is None else num_cpu_blocks) if cpu_attention else 0
    # The simulated prompts are all one token repeated: they stand for distinct prompts, so nothing is cached.
    config = SchedulerConfig(num_blocks=num_gpu, block_size=block_size, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=False)
    neo = NeoConfig.from_knobs(neo or NeoKnobs(), num_cpu)
    cost = RooflineCostModel(shape, hardware, dtype_bytes, block_size, kv_element_bytes)
    setup = SystemSetup(num_gpu, num_cpu, max_model_len, max_num_batched_tokens, max_num_seqs)
    return NeoScheduler(config, neo, cost), setup


@dataclass(frozen=True)
class Comparison:
    """Tandem (offloading) and its GPU-only mode on the same workload and machine."""

    tandem: SimulationResult
    gpu_only: SimulationResult
    setup: SystemSetup = field(compare=False)

    @property
    def relative_throughput(self) -> float:
        return self.tandem.output_throughput / self.gpu_only.output_throughput


def compare(shape: ModelShape, hardware: HardwareProfile, workload: Workload, **options) -> Comparison:
    """Simulate `workload` with and without offloading; `options` go to `build_scheduler`."""
    tandem, setup = build_scheduler(shape, hardware, workload, cpu_attention=True, **options)
    gpu_only, _ = build_scheduler(shape, hardware, workload, cpu_attention=False, **options)
    return Comparison(simulate(tandem, workload), simulate(gpu_only, workload), setup)
