"""Hot experts: which of a MoE layer's experts keep a slot on the GPU, chosen by measured
popularity (the rest are computed by the CPU where they are stored, or fetched for a big batch).
Plain Python, no torch: the engine keeps the statistics and asks this module what to change;
`tandem plan` asks it what hit rate and speed to expect.

- `ExpertWindow`: one layer's routed (token, expert) pairs per expert over a sliding window of
  the last `window_tokens` tokens, kept as buckets so old traffic leaves in steps.
- `choose_changes`: the promotions (and the demotions that free their slots) the window asks for.
  A candidate must beat its victim by `PROMOTION_MARGIN` so two experts of equal popularity do
  not trade places every step.
- `plan_expert_cache`: the slots per routed layer a `--weights-gpu-gib` budget leaves.
- `expected_hit_rate`: the share of routed pairs the hottest `num_slots` experts take under a
  Zipf-like popularity, each token choosing its top-k without replacement.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Sequence

from scheduler.modes import Mode
from scheduler.planning.cost_model import ModelShape
from scheduler.planning.memory import WeightFormat, image_layout, layer_image_bytes
from scheduler.planning.placement import PlacementError
from scheduler.planning.slicing.rates import SliceRates
from scheduler.planning.slicing.cost import SlicingCosts
from scheduler.planning.slicing.model import layer_time_s, moe_mlp_work

DEFAULT_WINDOW_TOKENS = 2048  # per layer; the hot set follows a shift in popularity within about one window
NUM_WINDOW_BUCKETS = 8
PROMOTION_MARGIN = 0.25  # a candidate needs this many more routed pairs than its victim, relatively
MAX_PROMOTIONS_IN_FLIGHT = 2  # per layer: background copies queued at once
DEFAULT_FETCH_BUFFERS = 4  # GPU buffers a big batch's fetched experts pass through
DEFAULT_SKEW = 1.0  # `tandem plan`'s Zipf exponent of expert popularity when none is given
HIT_RATE_SAMPLES = 4000


class HotExperts(Mode):
    """--hot-experts' words; a number of slots per routed layer is the other value it takes."""

    AUTO = "auto"  # where the experts do not fit the GPU's weight budget, as many as it leaves
    OFF = "off"


def parse_hot_experts(value: "HotExperts | int | str") -> "HotExperts | int":
    """--hot-experts: auto, off, or N experts per routed layer (the word or the number);
    ValueError saying what it takes otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in (HotExperts.AUTO, HotExperts.OFF):
            return HotExperts(text)
        if text.isdigit():
            return int(text)
    raise ValueError(f"must be auto, off or a number of experts per layer, got {value!r}")


class ExpertWindow:
    """Routed pairs per expert over the last `window_tokens` tokens of one layer: buckets of
    window_tokens / NUM_WINDOW_BUCKETS tokens each, the oldest dropped as a new one fills."""

    def __init__(self, num_experts: int, num_experts_per_token: int, window_tokens: int = DEFAULT_WINDOW_TOKENS,
                 num_buckets: int = NUM_WINDOW_BUCKETS) -> None:
        if window_tokens < num_buckets:
            raise ValueError(f"window_tokens={window_tokens} must be at least num_buckets={num_buckets}")
        self.num_experts = num_experts
        self.top_k = num_experts_per_token
        self.bucket_pairs = window_tokens // num_buckets * num_experts_per_token
        self._full: deque[list[int]] = deque()
        self._num_full = num_buckets - 1
        self._current = [0] * num_experts
        self._current_pairs = 0
        self._totals = [0] * num_experts
        self.num_pairs_seen = 0  # since start, for rates

    def add(self, counts: Sequence[int]) -> None:
        """One forward's routed pairs per expert."""
        current, totals = self._current, self._totals
        pairs = 0
        for expert, count in enumerate(counts):
            if count:
                current[expert] += count
                totals[expert] += count
                pairs += count
        self._current_pairs += pairs
        self.num_pairs_seen += pairs
        if self._current_pairs >= self.bucket_pairs:
            self._close_bucket()

    def _close_bucket(self) -> None:
        self._full.append(self._current)
        if len(self._full) > self._num_full:
            for expert, count in enumerate(self._full.popleft()):
                self._totals[expert] -= count
        self._current = [0] * self.num_experts
        self._current_pairs = 0

    @property
    def counts(self) -> list[int]:
        """Routed pairs per expert in the window."""
        return list(self._totals)

    def seed(self, counts: Sequence[int]) -> None:
        """Start from saved statistics (a previous run's window), as one full bucket."""
        if len(counts) != self.num_experts:
            raise ValueError(f"{len(counts)} saved counts for {self.num_experts} experts")
        self.add([max(0, int(count)) for count in counts])
        if self._current_pairs:
            self._close_bucket()


def rank_experts(counts: Sequence[int]) -> list[int]:
    """Experts hottest first; ties by index, so a ranking is reproducible."""
    return sorted(range(len(counts)), key=lambda expert: (-counts[expert], expert))


def coldest_first(counts: Sequence[int], experts) -> list[int]:
    """`experts` coldest first; ties: the higher index first (the reverse of `rank_experts`)."""
    return sorted(experts, key=lambda expert: (counts[expert], -expert))


def choose_changes(counts: Sequence[int], hot: set[int], pending: set[int], num_slots: int,
                   max_new: int = MAX_PROMOTIONS_IN_FLIGHT) -> list[tuple[int | None, int]]:
    """(victim or None for a free slot, candidate) pairs: the experts to promote, hottest first,
    each with the resident expert it displaces. `hot`: experts resident now; `pending`: being
    copied in (they hold their slots). At most `max_new` - len(pending) changes."""
    room = max_new - len(pending)
    if room <= 0:
        return []
    candidates = [e for e in rank_experts(counts) if e not in hot and e not in pending and counts[e] > 0]
    num_free = num_slots - len(hot) - len(pending)
    changes: list[tuple[int | None, int]] = [(None, e) for e in candidates[:max(0, min(num_free, room))]]
    victims = coldest_first(counts, hot)
    for candidate, victim in zip(candidates[len(changes):], victims):
        if len(changes) >= room or counts[candidate] <= counts[victim] * (1.0 + PROMOTION_MARGIN):
            break
        changes.append((victim, candidate))
    return changes


# ---- what to expect --------------------------------------------------------------------------
def zipf_popularity(num_experts: int, exponent: float) -> list[float]:
    """p_i proportional to 1 / (i + 1)^exponent, hottest first (0: uniform)."""
    weights = [1.0 / (rank + 1) ** exponent for rank in range(num_experts)]
    total = sum(weights)
    return [weight / total for weight in weights]


def inclusion_probabilities(popularity: Sequence[float], num_experts_per_token: int,
                            num_samples: int = HIT_RATE_SAMPLES, seed: int = 0) -> list[float]:
    """How often each expert is among a token's k choices when a token draws k without replacement
    in proportion to popularity (Gumbel top-k), estimated over `num_samples` tokens."""
    rng = random.Random(seed)
    logs = [math.log(p) if p > 0 else -math.inf for p in popularity]
    hits = [0] * len(popularity)
    for _ in range(num_samples):
        keys = [log - math.log(-math.log(rng.random() or 1e-300)) for log in logs]
        for expert in sorted(range(len(keys)), key=keys.__getitem__, reverse=True)[:num_experts_per_token]:
            hits[expert] += 1
    return [count / num_samples for count in hits]


def expected_hit_rate(popularity: Sequence[float], num_experts_per_token: int, num_slots: int) -> float:
    """The share of routed pairs that land on the `num_slots` most popular experts."""
    inclusion = sorted(inclusion_probabilities(popularity, num_experts_per_token), reverse=True)
    return sum(inclusion[:num_slots]) / num_experts_per_token


# ---- sizing the cache --------------------------------------------------------------------------
def expert_image_bytes(shape: ModelShape, fmt: WeightFormat) -> int:
    """One routed expert's gate/up and down as an image (what a slot holds, what a copy moves)."""
    sizes: list[int] = []
    for out_features, in_features in ((2 * shape.expert_intermediate_size, shape.hidden_size),
                                      (shape.hidden_size, shape.expert_intermediate_size)):
        sizes += fmt.linear_tensor_bytes(out_features, in_features)
    return image_layout(sizes)[1]


def layer_resident_bytes(shape: ModelShape, fmt: WeightFormat, layer: int) -> int:
    """A layer's weights other than its routed experts: attention, router, shared expert (a dense
    layer: all of it)."""
    if not shape.is_moe_layer(layer):
        return layer_image_bytes(_dense_twin(shape), fmt)
    return layer_image_bytes(shape, fmt, skip=lambda name: name.startswith("experts."))


def _dense_twin(shape: ModelShape) -> ModelShape:
    return replace(shape, num_experts=0, num_experts_per_token=0, expert_intermediate_size=0,
                   shared_expert_intermediate_size=0, dense_mlp_layers=())


@dataclass(frozen=True)
class ExpertCachePlan:
    """The hot-expert cache a budget allows: every routed layer keeps `num_slots` experts on the GPU."""

    num_experts: int
    num_experts_per_token: int
    num_slots: int  # per routed layer
    num_routed_layers: int
    expert_bytes: int
    num_fetch_buffers: int  # experts a big batch may fetch per layer
    resident_bytes: int  # the GPU's weights besides the slots and fetch buffers
    window_tokens: int
    skew: float  # the Zipf exponent the expectations below assume
    expected_hit_rate: float  # with the hottest experts resident
    static_hit_rate: float  # the same number resident in index order (today's --mlp-slicing)

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.num_routed_layers * self.expert_bytes

    @property
    def fetch_bytes(self) -> int:
        return self.num_fetch_buffers * self.expert_bytes

    @property
    def gpu_bytes(self) -> int:
        return self.resident_bytes + self.slot_bytes + self.fetch_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "slot_bytes": self.slot_bytes, "gpu_bytes": self.gpu_bytes}


def plan_expert_cache(shape: ModelShape, fmt: WeightFormat, global_bytes: int, gpu_weight_bytes: int | None,
                      num_slots: int | None = None, num_fetch_buffers: int = DEFAULT_FETCH_BUFFERS,
                      window_tokens: int = DEFAULT_WINDOW_TOKENS, skew: float = DEFAULT_SKEW) -> ExpertCachePlan:
    """Slots per routed layer: `num_slots` if given, else as many as `gpu_weight_bytes` leaves
    after the globals, every layer's non-expert weights and the fetch buffers (all of them
    without a budget). PlacementError naming the flag when the rest alone does not fit."""
    if not shape.is_moe:
        raise ValueError("a hot-expert cache needs a mixture-of-experts model")
    expert_bytes = expert_image_bytes(shape, fmt)
    routed = [layer for layer in range(shape.num_layers) if shape.is_moe_layer(layer)]
    resident = global_bytes + sum(layer_resident_bytes(shape, fmt, layer) for layer in range(shape.num_layers))
    fetch = min(num_fetch_buffers, shape.num_experts)
    if num_slots is None:
        num_slots = shape.num_experts
        if gpu_weight_bytes is not None:
            room = gpu_weight_bytes - resident - fetch * expert_bytes
            if room < 0:
                need = (resident + fetch * expert_bytes) / 2**30
                raise PlacementError(f"the layers' weights besides their routed experts (and {fetch} fetch buffers) "
                                     f"take {need:.2f} GiB, more than --weights-gpu-gib "
                                     f"({gpu_weight_bytes / 2**30:.2f}); give at least that")
            num_slots = min(shape.num_experts, room // (expert_bytes * max(1, len(routed))))
    if not 0 <= num_slots <= shape.num_experts:
        raise PlacementError(f"--hot-experts {num_slots} must lie in [0, {shape.num_experts}] "
                             "(the experts a layer has)")
    popularity = zipf_popularity(shape.num_experts, skew)
    k = shape.num_experts_per_token
    return ExpertCachePlan(shape.num_experts, k, num_slots, len(routed), expert_bytes, fetch, resident,
                           window_tokens, skew, expected_hit_rate(popularity, k, num_slots),
                           num_slots / shape.num_experts)


# ---- what it buys ------------------------------------------------------------------------------
def routed_layer_time_s(shape: ModelShape, fmt: WeightFormat, costs: SlicingCosts, num_tokens: int,
                        gpu_share: float) -> float:
    """A routed layer's experts at `num_tokens` tokens when `gpu_share` of the routed pairs run on
    the GPU and the rest on the CPU (ScheInfer's layer model, the shares as CC/GG rates)."""
    work = moe_mlp_work(shape.hidden_size, shape.expert_intermediate_size, shape.num_experts,
                        shape.num_experts_per_token, num_tokens, fmt)
    gpu_share = min(1.0, max(0.0, gpu_share))
    return layer_time_s(work, costs, SliceRates(1.0 - gpu_share, 0.0, gpu_share))


def expert_speeds(plan: ExpertCachePlan, shape: ModelShape, fmt: WeightFormat, costs: SlicingCosts,
                  decode_tokens: int, prefill_tokens: int) -> dict[str, tuple[float, float]]:
    """Tokens/s of the routed experts alone (every routed layer, nothing else), at a decode of
    `decode_tokens` and a prefill chunk of `prefill_tokens`: the hot-expert cache at its expected
    hit rate (the CPU taking hot experts too where that is faster: every expert is in host memory),
    the same slots placed in index order (their experts only on the GPU), and every expert on the CPU."""
    def tokens_per_s(num_tokens: int, gpu_shares: list[float]) -> float:
        layer_s = min(routed_layer_time_s(shape, fmt, costs, num_tokens, share) for share in gpu_shares)
        return num_tokens / (plan.num_routed_layers * layer_s)
    steps = [step / plan.num_experts for step in range(plan.num_experts + 1)]
    shares = {"hot experts": [share for share in steps if share < plan.expected_hit_rate] + [plan.expected_hit_rate],
              "static (index order)": [plan.static_hit_rate], "all on the CPU": [0.0]}
    return {name: (tokens_per_s(decode_tokens, options), tokens_per_s(prefill_tokens, options))
            for name, options in shares.items()}


def describe_expert_speeds(plan: ExpertCachePlan, shape: ModelShape, fmt: WeightFormat, costs: SlicingCosts,
                           decode_tokens: int, prefill_tokens: int) -> str:
    speeds = expert_speeds(plan, shape, fmt, costs, decode_tokens, prefill_tokens)
    lines = [f"routed experts alone, predicted by the slicing models (decode of {decode_tokens} tokens, "
             f"prefill of {prefill_tokens}; fetches not counted):"]
    for name, (decode, prefill) in speeds.items():
        lines.append(f"  {name:<22} decode {decode:9.1f} tok/s   prefill {prefill:9.1f} tok/s")
    return "\n".join(lines)


def describe_expert_cache(plan: ExpertCachePlan) -> str:
    """The cache's size and expected hit rate."""
    lines = [f"hot experts: {plan.num_slots} of {plan.num_experts} per routed layer on the GPU "
             f"({plan.slot_bytes / 2**30:.2f} GiB in {plan.num_routed_layers} layers, {plan.num_fetch_buffers} fetch "
             f"buffers of {plan.expert_bytes / 2**20:.1f} MiB), the rest computed by the CPU; statistics over the "
             f"last {plan.window_tokens} tokens per layer",
             f"expected hit rate at Zipf skew {plan.skew:g}: {plan.expected_hit_rate:.0%} of routed pairs on the GPU "
             f"(index-order static placement: {plan.static_hit_rate:.0%})"]
    return "\n".join(lines)
