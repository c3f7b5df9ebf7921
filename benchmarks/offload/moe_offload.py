"""A MoE model's experts at a quarter of them on the GPU: the hot-expert cache against ScheInfer's
static slicing by whole experts and against every expert on the CPU, on the host-only testbed.

Model: the qwen3-moe-1b-a400m preset (24 layers, 32 experts, top-8, 1.33B parameters) with random
weights, device testbed (one core plays the GPU, the other the CPU), dtype auto (float32 there).
Every configuration keeps a quarter of each routed layer's experts on the GPU (8 of 32):
  hot experts     --hot-experts 8: each layer's most-routed experts of a sliding window (this run's
                  window: --window-tokens per layer, 1024 by default where the engine's is 2048, so
                  warm-up and the shift below stay short), misses computed by the CPU, a big batch's
                  misses fetched
  static slicing  --mlp-slicing 0.75,0: experts [0, 24) computed by the CPU, the last 8 resident,
                  chosen by index
  all on the CPU  --mlp-slicing 1,0
  auto slicing    (--with-auto) --mlp-slicing auto within the hot-expert engine's GPU weight bytes

Routing skewed as trained routers' is: random weights route nearly uniformly, so once an engine is
built every routed layer's router is wrapped to route by softmax(gate(x) + log p[e]), p a Zipf
popularity (exponent --zipf-exponent, 1.0) laid over a seeded random permutation of the expert ids,
one per layer, so an expert's index says nothing of its popularity; top-k and renormalisation as
the model's own router. A second permutation per layer is the popularity shift's.

Measured per configuration, after a warm-up of at least one window of decode traffic (the cache's
hot sets settle): decode tokens/s of --streams greedy streams (short fresh prompts, --decode-tokens
each, ignore_eos) from the first iteration after every prefill; prefill tokens/s of
--prefill-prompts fresh prompts of --prefill-len tokens (max_tokens 1). The configurations' engines
are built one or two at a time (two where memory holds a second beside the first:
--engines-at-once), repetitions interleaved within each group, medians; the results say which.
Hit rate in the decode phase: the share of routed pairs computed from GPU-resident experts (the
cache: the engine's counters, hits / (hits + misses + fetched), the fetched share apart; a static
slicing: the pairs routed to its resident experts, counted by the wrapper) against the ideal (the
share routed to each layer's most popular experts, counted by the wrapper) and against
`expected_hit_rate` for the same Zipf. That one draws each token's experts in proportion to p
(Gumbel noise of std 1.28 on the logits); a random gate adds less (std about 0.02 * sqrt(hidden),
0.64 here), so the routing is more concentrated and the ideal lies above it.
Popularity shift: the cache's engine decodes on, its hit rate per --shift-interval-tokens tokens
per layer; after --shift-windows windows the routers switch to the second permutation; the
pre-shift rate, the lowest after it, and the tokens per layer until it is back within 10%.

    nice -n 10 .venv/bin/python -m benchmarks.offload.moe_offload [--reps 3] [--with-auto]
    .venv/bin/python -m benchmarks.offload.moe_offload --quick   (smoke run: the tiny MoE, no shift)
    python3 -m benchmarks.offload.moe_offload --device cuda ...   (on a GPU: the copies by its copy engine)

Writes benchmarks/results/moe_offload.json, .md (its block in docs/benchmarks.md) and
moe_offload_shift.png.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import torch

from benchmarks.report import RESULTS_DIR, median_rows, run_interleaved, write_results
from engine.model.moe import Routing

RESULTS = RESULTS_DIR / "moe_offload.json"
CACHE, STATIC, ALL_CPU, AUTO = "hot experts", "static slicing", "all on the CPU", "auto slicing"
DECODE_TARGET = 1.3  # hot experts over static slicing, decode tokens/s
PREFILL_TARGET = 1.2
RECOVERY_TOLERANCE = 0.1  # recovered: back within this share of the pre-shift hit rate
MEMORY_MARGIN = 1.5  # a second engine is built only where this many times the first's bytes are free
POST_SHIFT_MULTIPLE = 2  # the shift run decodes this many times as long after the shift as before it
PAIR_FIELDS = ("num_hit_pairs", "num_miss_pairs", "num_fetched_pairs", "num_hit_pairs_on_cpu", "num_expert_promotions")
SHIFT_FIELDS = ("hit_rate", "gpu_rate", "ideal_rate", "num_promotions")
TIME_FIELDS = ("cc_s", "gpu_expert_s")  # each side's seconds computing experts (the GPU's: the cache's only)


# --quick's sizes: the tiny MoE preset, short rounds, one engine at a time, no popularity shift
QUICK = {"model": "qwen3-moe-tiny", "reps": 1, "streams": [1, 2], "decode_tokens": 8, "prefill_prompts": 2,
         "prefill_len": 32, "window_tokens": 64, "shift_windows": 0.0, "kv_cache_gib": 0.05, "engines_at_once": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-moe-1b-a400m", help="a MoE preset (dummy weights)")
    parser.add_argument("--expert-share", type=float, default=0.25, help="of each layer's experts, on the GPU")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8],
                        help="decode streams at once, one decode measurement per count")
    parser.add_argument("--prompt-len", type=int, default=16, help="the decode streams' prompts")
    parser.add_argument("--decode-tokens", type=int, default=32, help="output tokens per stream")
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window-tokens", type=int, default=1024, help="the cache's window per layer")
    parser.add_argument("--zipf-exponent", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="of the popularity permutations and the prompts")
    parser.add_argument("--shift-windows", type=float, default=1.0,
                        help="windows of decode before the popularity shift; twice that after it")
    parser.add_argument("--shift-interval-tokens", type=int, default=64, help="tokens per layer per hit-rate sample")
    parser.add_argument("--engines-at-once", type=int, choices=(1, 2), default=2,
                        help="at most this many engines built together (a second only where memory holds it)")
    parser.add_argument("--with-auto", action="store_true", help="also --mlp-slicing auto (solves at start)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--device", choices=["testbed", "cuda"], default="testbed")
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    return args


# ---- the skewed routers --------------------------------------------------------------------
class SkewedRouter:
    """A TopKRouter's interface (`route(x) -> Routing`, `gate`) routing by softmax(gate(x) + log p):
    one popularity order per phase (expert ids, most popular first), `phase` choosing which; the
    routed pairs per expert counted in `counts` (the ideal hit rate's numbers)."""

    def __init__(self, router, popularity: list[float], orders: list[list[int]], device: torch.device) -> None:
        self.gate = router.gate  # [num_experts, hidden]; SparseMoe.linear_weights lists it
        self.top_k = router.top_k
        self.normalize = router.normalize
        self.orders = orders
        self.log_popularities = [log_popularity(popularity, order).to(device) for order in orders]  # [num_experts] each
        self.phase = 0
        self.counts = torch.zeros(len(popularity), dtype=torch.int64, device=device)  # [num_experts]

    def route(self, x: torch.Tensor) -> Routing:
        logits = self.gate.apply(x).float() + self.log_popularities[self.phase]  # [num_tokens, num_experts]
        weights, expert_ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.counts += torch.bincount(expert_ids.flatten(), minlength=self.counts.numel())
        return Routing(expert_ids, weights)

    def share_to(self, experts: list[int]) -> tuple[int, int]:
        """(pairs routed to `experts`, all pairs) since the counts were zeroed."""
        counts = self.counts.tolist()
        return sum(counts[e] for e in experts), sum(counts)


def popularity_order(num_experts: int, seed: int, layer: int, phase: int) -> list[int]:
    """Expert ids, most popular first: a permutation drawn from (seed, layer, phase)."""
    return random.Random(f"{seed}:{layer}:{phase}").sample(range(num_experts), num_experts)


def log_popularity(popularity: list[float], order: list[int]) -> torch.Tensor:
    """log p[e], where expert order[r] has the r-th largest popularity."""
    log_p = torch.empty(len(order), dtype=torch.float32)  # [num_experts]
    for rank, expert in enumerate(order):
        log_p[expert] = math.log(popularity[rank])
    return log_p


def skew_routers(model, zipf_exponent: float, seed: int) -> dict[int, SkewedRouter]:
    """Every routed layer's router wrapped in place; layer -> its wrapper."""
    from scheduler.planning.experts.hot_experts import zipf_popularity

    routers = {}
    for layer, weights in enumerate(model.layers):
        if not hasattr(weights.mlp, "router"):
            continue  # a dense layer
        num_experts = len(weights.mlp.experts)
        orders = [popularity_order(num_experts, seed, layer, phase) for phase in (0, 1)]
        popularity = zipf_popularity(num_experts, zipf_exponent)
        routers[layer] = weights.mlp.router = SkewedRouter(weights.mlp.router, popularity, orders, model.device)
    if not routers:
        raise ValueError("the model has no routed layers: give a mixture-of-experts preset")
    return routers


# ---- the configurations --------------------------------------------------------------------
def common_flags(args: argparse.Namespace) -> dict:
    shift_run_tokens = (1 + POST_SHIFT_MULTIPLE) * args.shift_windows * args.window_tokens
    decode_len = args.prompt_len + max(args.decode_tokens, math.ceil(shift_run_tokens / max(args.streams)) + 64)
    return dict(model=args.model, load_format="dummy", device=args.device, dtype="auto", cpu_attention="off",
                max_num_seqs=max(*args.streams, args.prefill_prompts),
                max_model_len=max(args.prefill_len + 1, decode_len), kv_cache_memory_gib=args.kv_cache_gib,
                expert_window_tokens=args.window_tokens)


def expert_budget(expert_share: float, num_experts: int) -> int:
    """Experts per routed layer on the GPU, in every configuration."""
    return round(expert_share * num_experts)


def configurations(args: argparse.Namespace, num_experts: int) -> dict[str, dict]:
    """Name -> flags, each with the same number of experts per layer on the GPU (auto slicing's
    budget is added once the hot-expert engine's GPU bytes are known)."""
    num_slots = expert_budget(args.expert_share, num_experts)
    configs = {CACHE: dict(hot_experts=str(num_slots)), STATIC: dict(mlp_slicing=f"{1 - num_slots / num_experts:g},0"),
               ALL_CPU: dict(mlp_slicing="1,0")}
    if args.with_auto:
        configs[AUTO] = dict(mlp_slicing="auto")
    return {name: {**common_flags(args), **flags} for name, flags in configs.items()}


@dataclass
class Bench:
    """One configuration's engine with its routers wrapped, and where its experts compute."""

    name: str
    llm: object  # engine.LLM
    routers: dict[int, SkewedRouter]
    num_slots: int  # experts per routed layer on the GPU
    gpu_experts: dict[int, list[int]] | None  # sliced: each routed layer's GPU-resident experts; None: the cache
    prompts: random.Random
    facts: dict  # what the build cost and holds

    @property
    def engine(self):
        return self.llm.engine

    @property
    def phase(self) -> int:
        return next(iter(self.routers.values())).phase

    def set_phase(self, phase: int) -> None:
        for router in self.routers.values():
            router.phase = phase

    def reset_counts(self) -> None:
        for router in self.routers.values():
            router.counts.zero_()

    def prompt(self, num_tokens: int) -> list[int]:
        """Fresh random token ids: no prefix cache hit between repetitions."""
        return [self.prompts.randrange(2, self.engine.model_config.vocab_size) for _ in range(num_tokens)]


def build(name: str, flags: dict, args: argparse.Namespace) -> Bench:
    from engine import LLM

    gc.collect()
    rss_before, start = resident_bytes(), time.perf_counter()
    llm = LLM(**flags)
    build_s = time.perf_counter() - start
    model = llm.engine.runner.model
    if hasattr(model.layer_store, "stats_path"):
        model.layer_store.stats_path = None  # the skew is this benchmark's: leave no windows to seed later runs
    routers = skew_routers(model, args.zipf_exponent, args.seed)
    num_experts = len(model.layers[min(routers)].mlp.experts)
    rates = llm.engine.plan.layers.rates
    gpu_experts = None
    if rates is not None:  # experts [0, cc) computed by the CPU, the rest on the GPU (streamed or resident)
        gpu_experts = {layer: list(range(rates[layer].counts(num_experts)[0], num_experts)) for layer in routers}
    facts = {"flags": {k: v for k, v in flags.items() if k not in common_flags(args)},
             "gpu_weight_bytes": model.gpu_weight_bytes(), "build_s": build_s,
             "built_bytes": resident_bytes() - rss_before, "dtype": str(llm.engine.dtype).removeprefix("torch.")}
    return Bench(name, llm, routers, expert_budget(args.expert_share, num_experts), gpu_experts,
                 random.Random(f"{args.seed}:prompts"), facts)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- measuring -----------------------------------------------------------------------------
def pair_counts(engine) -> dict[str, int]:
    return {name: getattr(engine.weight_stats, name) for name in PAIR_FIELDS}


def routed_shares(bench: Bench, before: dict[str, int]) -> dict:
    """Since `before` (and the routers' counts were zeroed): the share of routed pairs computed from
    GPU-resident experts (the cache's slots; a static slicing's resident experts by the routing
    itself), the share fetched, and the ideal: the share routed to each layer's most popular experts."""
    after = pair_counts(bench.engine)
    delta = {name: after[name] - before[name] for name in PAIR_FIELDS}
    ideal = [router.share_to(router.orders[router.phase][:bench.num_slots]) for router in bench.routers.values()]
    num_routed = sum(total for _, total in ideal)
    shares = {"num_routed_pairs": num_routed, "ideal_rate": sum(top for top, _ in ideal) / max(1, num_routed),
              "num_promotions": delta["num_expert_promotions"]}
    if bench.gpu_experts is None:  # the cache: hits are pairs to a hot expert, wherever they computed
        num_pairs = delta["num_hit_pairs"] + delta["num_miss_pairs"]
        on_gpu = delta["num_hit_pairs"] - delta["num_hit_pairs_on_cpu"] + delta["num_fetched_pairs"]
        return {**shares, "hit_rate": delta["num_hit_pairs"] / max(1, num_pairs),
                "gpu_rate": on_gpu / max(1, num_pairs),
                "fetched_rate": delta["num_fetched_pairs"] / max(1, num_pairs), "num_pairs": num_pairs}
    resident = [router.share_to(bench.gpu_experts[layer]) for layer, router in bench.routers.items()]
    hit_rate = sum(on_gpu for on_gpu, _ in resident) / max(1, num_routed)
    return {**shares, "hit_rate": hit_rate, "gpu_rate": hit_rate, "fetched_rate": 0.0, "num_pairs": num_routed}


def step_until_first_tokens(engine, produced: dict[str, int], num_requests: int) -> None:
    """Step until every request has its first token (its prefill done): later steps only decode."""
    while len(produced) < num_requests or min(produced.values()) < 1:
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)


def step_once(engine, produced: dict[str, int]) -> None:
    for output in engine.step():
        produced[output.request_id] = len(output.outputs[0].token_ids)


def decode_round(bench: Bench, args: argparse.Namespace, num_streams: int) -> dict:
    """The streams' decode tokens/s from the first iteration after every prefill, and the routed
    pairs' shares over those iterations."""
    from scheduler.sampling_params import SamplingParams

    engine = bench.engine
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(num_streams):
        engine.add_request(bench.prompt(args.prompt_len), params)
    produced: dict[str, int] = {}
    step_until_first_tokens(engine, produced, num_streams)
    tokens_before, before = sum(produced.values()), pair_counts(engine)
    times_before = {name: getattr(engine.weight_stats, name) for name in TIME_FIELDS}
    bench.reset_counts()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_once(engine, produced)
    elapsed_s = time.perf_counter() - start
    shares = routed_shares(bench, before)
    # the share of the round each side spent on experts (the even-split estimate in `summarize`)
    shares.update({f"{name}_share": (getattr(engine.weight_stats, name) - times_before[name]) / elapsed_s
                   for name in TIME_FIELDS})
    return {f"decode{num_streams}_tokens_per_s": (sum(produced.values()) - tokens_before) / elapsed_s,
            **{f"decode{num_streams}_{name}": value for name, value in shares.items()}}


def prefill_round(bench: Bench, args: argparse.Namespace) -> dict:
    """Prefill tokens/s of fresh prompts sent together, one output token each."""
    from scheduler.sampling_params import SamplingParams

    engine = bench.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = [bench.prompt(args.prefill_len) for _ in range(args.prefill_prompts)]
    before = pair_counts(engine)
    bench.reset_counts()
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    elapsed_s = time.perf_counter() - start
    shares = routed_shares(bench, before)
    return {"prefill_tokens_per_s": args.prefill_prompts * args.prefill_len / elapsed_s,
            "prefill_hit_rate": shares["hit_rate"], "prefill_gpu_rate": shares["gpu_rate"],
            "prefill_fetched_rate": shares["fetched_rate"]}


def warm_up(bench: Bench, args: argparse.Namespace) -> None:
    """First-forward costs paid; with the cache, at least one window of decode tokens per layer
    routed first, so its hot sets have settled on the popularity."""
    prefill_round(bench, args)
    needed = args.window_tokens if bench.gpu_experts is None else 1
    routed = 0
    while routed < needed:
        decode_round(bench, args, max(args.streams))
        routed += max(args.streams) * args.decode_tokens
    if sum(router.share_to([])[1] for router in bench.routers.values()) == 0:
        raise RuntimeError(f"{bench.name}: the wrapped routers saw no tokens (the layers route without .router)")
    bench.facts["warm_up_decode_tokens_per_layer"] = routed


def measure_rep(bench: Bench, args: argparse.Namespace) -> dict:
    decodes = [decode_round(bench, args, num_streams) for num_streams in args.streams]
    return {key: value for decode in decodes for key, value in decode.items()} | prefill_round(bench, args)


# ---- the popularity shift ------------------------------------------------------------------
def popularity_shift(bench: Bench, args: argparse.Namespace) -> dict:
    """The cache's hit rate per interval of continuous decode; after `shift_windows` windows of
    tokens per layer the routers switch to their second permutation, and the decode runs on for
    twice as long. Tokens per layer: each decode step routes one token per stream through each."""
    from scheduler.sampling_params import SamplingParams

    engine, num_streams = bench.engine, max(args.streams)
    shift_tokens = round(args.shift_windows * args.window_tokens)
    steps_per_interval = max(1, round(args.shift_interval_tokens / num_streams))
    run_tokens = (1 + POST_SHIFT_MULTIPLE) * shift_tokens
    params = SamplingParams(max_tokens=math.ceil(run_tokens / num_streams) + steps_per_interval + 1,
                            temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(bench.prompt(args.prompt_len), params) for _ in range(num_streams)]
    produced: dict[str, int] = {}
    step_until_first_tokens(engine, produced, num_streams)
    start_tokens, intervals, shifted_at = sum(produced.values()), [], None
    while (routed := sum(produced.values()) - start_tokens) < run_tokens:
        if shifted_at is None and routed >= shift_tokens:
            bench.set_phase(1)
            shifted_at = routed
        before = pair_counts(engine)
        bench.reset_counts()
        for _ in range(steps_per_interval):
            step_once(engine, produced)
        shares = routed_shares(bench, before)
        intervals.append({"end_tokens": sum(produced.values()) - start_tokens, "phase": bench.phase,
                          **{name: shares[name] for name in SHIFT_FIELDS}})
    for request_id in ids:
        engine.abort_request(request_id)
    bench.set_phase(0)
    return {"shift_tokens": shifted_at, "interval_tokens": steps_per_interval * num_streams,
            "intervals": intervals, **shift_summary(intervals, shifted_at)}


def shift_summary(intervals: list[dict], shifted_at: int) -> dict:
    """The hit rate before the shift, the lowest after it, and the tokens per layer from the shift
    until an interval's rate is back within RECOVERY_TOLERANCE of the pre-shift one (None: not in the run)."""
    before = [i["hit_rate"] for i in intervals if i["phase"] == 0]
    after = [i for i in intervals if i["phase"] == 1]
    if not before or not after:
        return {"pre_shift_hit_rate": None, "lowest_hit_rate": None, "recovery_tokens": None}
    pre = statistics.mean(before)
    lowest = min(range(len(after)), key=lambda index: after[index]["hit_rate"])
    recovered = next((i["end_tokens"] - shifted_at for i in after[lowest:]
                      if i["hit_rate"] >= (1.0 - RECOVERY_TOLERANCE) * pre), None)
    return {"pre_shift_hit_rate": pre, "lowest_hit_rate": after[lowest]["hit_rate"], "recovery_tokens": recovered}


# ---- the run -------------------------------------------------------------------------------
def measure_groups(configs: dict[str, dict], args: argparse.Namespace) -> tuple[dict, dict, dict | None, list]:
    """Each configuration's samples and build facts, the shift and the groups: engines built one
    or two at a time (a second only where memory holds it), repetitions interleaved within a group."""
    samples, facts, shift, groups = {}, {}, None, []
    pending = list(configs)
    while pending:
        group: dict[str, Bench] = {}
        try:
            while pending and len(group) < args.engines_at_once and (not group or room_for_another(group)):
                name = pending.pop(0)
                flags = configs[name]
                if name == AUTO:  # the same GPU weight bytes as the cache's slots, fetch buffers and the rest
                    flags = {**flags, "weights_gpu_gib": facts[CACHE]["gpu_weight_bytes"] / 2**30}
                group[name] = build(name, flags, args)
                warm_up(group[name], args)
                facts[name] = group[name].facts
                print(name, "built", facts[name], file=sys.stderr, flush=True)
            groups.append(list(group))
            samples.update(run_interleaved(group, args.reps, lambda bench: measure_rep(bench, args)))
            if CACHE in group and args.shift_windows > 0:
                shift = popularity_shift(group[CACHE], args)
        finally:
            for bench in group.values():
                bench.llm.close()
            group.clear()
            gc.collect()  # the next group's engines get this one's memory
    return samples, facts, shift, groups


def room_for_another(group: dict[str, Bench]) -> bool:
    return available_bytes() > MEMORY_MARGIN * max(bench.facts["built_bytes"] for bench in group.values())


def decode_metrics(rows: dict[str, dict]) -> list[str]:
    """decode<N>_tokens_per_s for each stream count measured, fewest streams first."""
    names = [key for key in next(iter(rows.values())) if key.startswith("decode") and key.endswith("_tokens_per_s")]
    return sorted(names, key=lambda name: int(name[len("decode"):-len("_tokens_per_s")]))


def summarize(rows: dict[str, dict], num_experts: int, top_k: int, num_slots: int, zipf_exponent: float) -> dict:
    """Hot experts over static slicing and over all on the CPU, beside the targets; the Zipf expectation."""
    from scheduler.planning.experts.hot_experts import expected_hit_rate, zipf_popularity

    cache = rows[CACHE]
    summary = {"expected_hit_rate": expected_hit_rate(zipf_popularity(num_experts, zipf_exponent), top_k, num_slots)}
    targets = [(metric, DECODE_TARGET) for metric in decode_metrics(rows)] + [("prefill_tokens_per_s", PREFILL_TARGET)]
    for metric, target in targets:
        vs_static = cache[metric] / rows[STATIC][metric]
        summary[metric] = {"vs_static": vs_static, "vs_all_cpu": cache[metric] / rows[ALL_CPU][metric],
                           "target_vs_static": target, "meets_target": vs_static >= target}
    for metric in decode_metrics(rows):
        summary[metric]["even_split_vs_static"] = even_split_estimate(cache, rows[STATIC], metric[:-len("_tokens_per_s")])
    return summary


def even_split_estimate(cache: dict, static: dict, decode: str) -> float:
    """What the cache would gain over static slicing with its experts split exactly evenly and the
    rest as static's: static's time per token less its CPU's expert time (the side its experts wait
    on), plus half the cache's expert time on both sides. Both sides are one vCPU each here, so an
    even split is the most any placement gains, give or take what the rest of a layer costs each."""
    static_s, cache_s = 1.0 / static[f"{decode}_tokens_per_s"], 1.0 / cache[f"{decode}_tokens_per_s"]
    experts_s = (cache[f"{decode}_cc_s_share"] + cache[f"{decode}_gpu_expert_s_share"]) * cache_s
    return static_s / (static_s * (1.0 - static[f"{decode}_cc_s_share"]) + experts_s / 2)


def where(result: dict) -> str:
    """The GPU side: a card, or the testbed's core."""
    if result.get("gpu"):
        return f"{result['gpu']} (experts copied by its copy engine)"
    return "host-only testbed (one core plays the GPU, the other the CPU)"


def setup_line(result: dict) -> str:
    """The machine, the model, the routing, the workload, the repetitions and the command."""
    s = result["setup"]
    grouping = ("engines built one at a time" if all(len(g) == 1 for g in result["groups"]) else
                "engines built " + " then ".join(" + ".join(g) for g in result["groups"]))
    return (f"{result['cpu']} ({result['num_cores']} cores, {result['memory_bytes'] / 2**30:.0f} GiB; peak resident "
            f"memory {result['peak_rss_bytes'] / 2**30:.1f} GiB), {where(result)}, {s['model']} with random weights in {s['dtype']}. Routers skewed as trained ones are: "
            f"softmax(gate(x) + log p), p Zipf ({s['zipf_exponent']:g}) over a seeded random permutation of each "
            f"layer's experts. Every configuration keeps {s['num_slots']} of {s['num_experts']} experts per routed "
            f"layer on the GPU (top-{s['top_k']}). Decode: {' and '.join(map(str, s['streams']))} greedy streams "
            f"x {s['decode_tokens']} tokens "
            f"after {s['prompt_len']}-token prompts; prefill: {s['prefill_prompts']} x {s['prefill_len']}-token "
            f"prompts. The cache's window: {s['window_tokens']} tokens per layer (the engine's default is 2048), "
            f"warmed by at least one window of decode. Medians of {result['reps']} repetitions, interleaved within a "
            f"group ({grouping}). Command: `{result['command']}`.")


def to_markdown(result: dict) -> str:
    rows, cache = result["rows"], result["rows"][CACHE]
    decodes = decode_metrics(rows)
    streams = [name[len("decode"):-len("_tokens_per_s")] for name in decodes]
    header = "".join(f" decode tokens/s, {n} stream{'s' if n != '1' else ''} | hot experts / this |" for n in streams)
    lines = [setup_line(result), "",
             f"| configuration | flags | GPU weights MiB |{header} prefill tokens/s | hot experts / this | "
             f"decode pairs on the GPU ({streams[-1]} streams) | prefill pairs on the GPU |",
             "|---|---|---|" + "---|---|" * len(decodes) + "---|---|---|---|"]
    for name, row in rows.items():
        facts = result["facts"][name]
        flags = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in facts["flags"].items())
        decode_cells = "".join(f" {row[m]:.2f} | {cache[m] / row[m]:.2f}x |" for m in decodes)
        prefill = row["prefill_tokens_per_s"]
        lines.append(f"| {name} | `{flags}` | {facts['gpu_weight_bytes'] / 2**20:.0f} |{decode_cells} {prefill:.1f} | "
                     f"{cache['prefill_tokens_per_s'] / prefill:.2f}x | {row[f'decode{streams[-1]}_gpu_rate']:.0%} | "
                     f"{row['prefill_gpu_rate']:.0%} |")
    return "\n".join(lines + ["", *summary_lines(result)]) + "\n"


def summary_lines(result: dict) -> list[str]:
    summary, rows, s = result["summary"], result["rows"], result["setup"]
    prefill, cache = summary["prefill_tokens_per_s"], rows[CACHE]
    decodes = decode_metrics(rows)
    most = decodes[-1][:-len("_tokens_per_s")]  # the most streams' decode: its hit rates below
    decode_text = ", ".join(f"decode at {m[len('decode'):-len('_tokens_per_s')]} streams "
                            f"{summary[m]['vs_static']:.2f}x (even split {summary[m]['even_split_vs_static']:.2f}x)"
                            for m in decodes)
    lines = [f"Hot experts vs static slicing: {decode_text} (target >= {DECODE_TARGET}x), prefill "
             f"{prefill['vs_static']:.2f}x (target >= {PREFILL_TARGET}x); vs all on the CPU: "
             + ", ".join(f"{summary[m]['vs_all_cpu']:.2f}x" for m in decodes)
             + f" decode, {prefill['vs_all_cpu']:.2f}x prefill. Even split: static slicing's time less its CPU's "
             "expert time, plus half of the cache's expert time on both sides, all measured in the rounds above (the "
             "testbed's two sides are one vCPU each, so splitting the experts evenly is the most any placement "
             "gains; the attention, the head and the rest of each layer stay on the GPU's time line).", "",
             f"Hit rate in decode ({most[len('decode'):]} streams): {cache[f'{most}_hit_rate']:.1%} of routed pairs to "
             f"a hot expert ({cache[f'{most}_gpu_rate']:.1%} computed on the GPU: hot experts the CPU took where the "
             f"GPU had more than its share, plus {cache[f'{most}_fetched_rate']:.1%} fetched; "
             f"{cache[f'{most}_num_promotions']:g} promotions in the timed round), against the ideal "
             f"{cache[f'{most}_ideal_rate']:.1%} (the share routed to each layer's {s['num_slots']} most popular "
             f"experts) and the Zipf expectation {summary['expected_hit_rate']:.1%} (`expected_hit_rate`, each token "
             f"drawing its experts in proportion to p: more spread than the random gate's logits add); static "
             f"slicing's experts resident by index took {rows[STATIC][f'{most}_hit_rate']:.1%}."]
    shift = result["shift"]
    if shift is not None and shift["pre_shift_hit_rate"] is not None:
        recovery = ("not within the run" if shift["recovery_tokens"] is None else
                    f"back within {RECOVERY_TOLERANCE:.0%} after {shift['recovery_tokens']} tokens per layer")
        lines += ["", f"Popularity shift (each layer's permutation swapped after {shift['shift_tokens']} decode tokens "
                      f"per layer, the hit rate sampled every {shift['interval_tokens']}): "
                      f"{shift['pre_shift_hit_rate']:.1%} before, lowest {shift['lowest_hit_rate']:.1%} after, "
                      f"{recovery} (window {s['window_tokens']} tokens per layer). "
                      f"Plot: `benchmarks/results/{result['plot']}`."]
    return lines


def plot_shift(shift: dict, window_tokens: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    intervals = shift["intervals"]
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    ax.plot([i["end_tokens"] for i in intervals], [i["hit_rate"] for i in intervals], marker="o", markersize=3,
            label="hot experts: pairs from slots")
    ax.plot([i["end_tokens"] for i in intervals], [i["ideal_rate"] for i in intervals], linestyle=":",
            label="ideal: pairs to the most popular experts")
    ax.axvline(shift["shift_tokens"], color="grey", linestyle="--", label="popularity shift")
    ax.axvline(shift["shift_tokens"] + window_tokens, color="grey", linestyle=":", label="shift + one window")
    ax.set_xlabel("decode tokens per layer")
    ax.set_ylabel("hit rate per interval")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from engine.model_config import ModelConfig
    from engine.profiling.cache import host_cpu_model

    model_config = ModelConfig.from_preset(args.model)
    num_experts, top_k = model_config.moe.num_experts, model_config.moe.num_experts_per_token
    samples, facts, shift, groups = measure_groups(configurations(args, num_experts), args)
    keys = [key for key in samples[CACHE][0] if isinstance(samples[CACHE][0][key], (int, float))]
    rows = median_rows(samples, keys)
    num_slots = expert_budget(args.expert_share, num_experts)
    setup = {**{k: v for k, v in vars(args).items() if k not in ("output", "no_plot")}, "num_experts": num_experts,
             "top_k": top_k, "num_slots": num_slots, "dtype": facts[CACHE]["dtype"]}
    plot = args.output.with_name(args.output.stem + "_shift.png")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = {"cpu": host_cpu_model(), "gpu": gpu, "num_cores": os.cpu_count(),
              "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "command": " ".join(["python -m benchmarks.offload.moe_offload", *argv]), "setup": setup, "reps": args.reps,
              "groups": groups, "facts": facts, "rows": rows,
              "summary": summarize(rows, num_experts, top_k, num_slots, args.zipf_exponent), "shift": shift,
              "plot": plot.name, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "samples": samples}
    write_results(args.output, result, to_markdown(result))
    if shift is not None and not args.no_plot:
        plot_shift(shift, args.window_tokens, plot)
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
