"""The multi-turn benchmark's numbers: a run's metrics, medians over repetitions, ratios, the table.

A run (one system, one repetition) holds `summarize` rows (benchmarks/load/stats.py) for all turns,
for the first turns and for the later ones, plus the server's /metrics deltas. A cache's hits
come from two places, where a server offers them: its /metrics counters (tandem:, vllm:) and the
cached prompt tokens its usage reports per request (llama.cpp, which has no such counters). Turn 1
and turns 2+ are kept apart because only a later turn repeats a prefix a cache can hold (the shared
system prompt aside). Ratios are the first system's over each other one (tandem/peer), paired by
repetition: below 1 the first system's TTFT is shorter, above 1 its throughput is higher.
"""
from __future__ import annotations

from benchmarks.load import report
from benchmarks.load.client import RequestRecord
from benchmarks.load.report import Metric, markdown_table, metric_cells, ms, ratio_cell
from benchmarks.load.stats import ratio_spread


# (key, column header, reader of a run, format); latencies in milliseconds
METRICS: tuple[Metric, ...] = (
    ("ttft_p50", "TTFT p50 ms", lambda r: ms(r["summary"]["ttft"]["p50"]), "{:.0f}"),
    ("ttft_p90", "TTFT p90 ms", lambda r: ms(r["summary"]["ttft"]["p90"]), "{:.0f}"),
    ("first_turn_ttft_p50", "turn 1 TTFT p50 ms", lambda r: ms(r["first_turn"]["ttft"]["p50"]), "{:.0f}"),
    ("first_turn_ttft_p90", "turn 1 TTFT p90 ms", lambda r: ms(r["first_turn"]["ttft"]["p90"]), "{:.0f}"),
    ("later_turns_ttft_p50", "turns 2+ TTFT p50 ms", lambda r: ms(r["later_turns"]["ttft"]["p50"]), "{:.0f}"),
    ("later_turns_ttft_p90", "turns 2+ TTFT p90 ms", lambda r: ms(r["later_turns"]["ttft"]["p90"]), "{:.0f}"),
    ("itl_p50", "ITL p50 ms", lambda r: ms(r["summary"]["itl"]["p50"]), "{:.1f}"),
    ("tpot_p50", "TPOT p50 ms", lambda r: ms(r["summary"]["tpot"]["p50"]), "{:.1f}"),
    ("output_throughput", "out tok/s", lambda r: r["summary"]["output_throughput"], "{:.1f}"),
    ("request_throughput", "req/s", lambda r: r["summary"]["request_throughput"], "{:.2f}"),
    ("prefix_cache_hit_rate", "prefix hit rate", lambda r: (r["prefix_cache"] or {}).get("hit_rate"), "{:.0%}"),
    ("usage_cached_fraction", "cached (usage)", lambda r: (r["usage_cached"] or {}).get("fraction"), "{:.0%}"),
)
# (key, column header) of the metrics compared with each peer
RATIO_METRICS = (("ttft_p50", "TTFT p50"), ("later_turns_ttft_p50", "turns 2+ TTFT p50"),
                 ("output_throughput", "out tok/s"))


def prefix_cache_stats(counters: dict[str, float] | None) -> dict | None:
    """Hit rate (tokens found / tokens looked up) from /metrics deltas, overall and per tier; None
    where the server exports no prefix-cache counters."""
    if not counters or "prefix_cache_queries" not in counters:
        return None

    def rate(hits: float, queries: float) -> float | None:
        return hits / queries if queries > 0 else None

    tiers = sorted(key.partition(":")[2] for key in counters if key.startswith("prefix_cache_queries:"))
    # tandem counts every prompt token once as a GPU-pool query and the host pool's queries are
    # the GPU pool's misses again: the prompt tokens are the GPU tier's queries, not the sum
    num_queries = counters.get("prefix_cache_queries:gpu", counters["prefix_cache_queries"])
    return {"num_queries": num_queries, "num_hits": counters.get("prefix_cache_hits", 0.0),
            "hit_rate": rate(counters.get("prefix_cache_hits", 0.0), num_queries),
            "by_tier": {tier: rate(counters.get(f"prefix_cache_hits:{tier}", 0.0),
                                   counters[f"prefix_cache_queries:{tier}"]) for tier in tiers}}


def usage_cached_stats(records: list[RequestRecord]) -> dict | None:
    """The share of prompt tokens the server's usage says its cache answered, over the successful
    requests whose usage says so (llama.cpp's does; vLLM's with --enable-prompt-tokens-details)."""
    reported = [r for r in records if r.ok and r.num_cached_prompt_tokens is not None and r.num_prompt_tokens]
    if not reported:
        return None
    num_prompt = sum(r.num_prompt_tokens for r in reported)
    num_cached = sum(r.num_cached_prompt_tokens for r in reported)
    return {"num_requests": len(reported), "num_prompt_tokens": num_prompt, "num_cached_tokens": num_cached,
            "fraction": num_cached / num_prompt}


def run_metrics(run: dict) -> dict[str, float | None]:
    return report.run_metrics(run, METRICS)


def median_metrics(runs: list[dict]) -> dict[str, float | None]:
    """Each metric's median over the runs that have it; None where none does."""
    return report.median_metrics(runs, METRICS)


def ratios(systems: list[dict]) -> list[dict]:
    """For each system after the first: the first's metric over its own, per repetition (median,
    min, max over repetitions; see stats.ratio_spread)."""
    if len(systems) < 2:
        return []
    baseline = systems[0]
    base_runs = {run["rep"]: run_metrics(run) for run in baseline["runs"]}
    rows = []
    for peer in systems[1:]:
        peer_runs = {run["rep"]: run_metrics(run) for run in peer["runs"]}
        reps = sorted(set(base_runs) & set(peer_runs))
        metrics = {}
        for key, _header in RATIO_METRICS:
            spread = ratio_spread([base_runs[r][key] for r in reps], [peer_runs[r][key] for r in reps])
            if spread is not None:
                metrics[key] = spread
        rows.append({"system": peer["name"], "baseline": baseline["name"], "metrics": metrics})
    return rows


def table(systems: list[dict], ratio_rows: list[dict]) -> str:
    """One markdown row per system: medians over repetitions, then the first system's ratio to it."""
    baseline = systems[0]["name"] if systems else ""
    ratio_headers = [f"{baseline}/this {header}" for _key, header in RATIO_METRICS] if ratio_rows else []
    header = ["system", "ok/sent"] + [m[1] for m in METRICS] + ratio_headers
    rows = []
    by_peer = {row["system"]: row["metrics"] for row in ratio_rows}
    for system in systems:
        medians = median_metrics(system["runs"])
        num_ok = sum(run["summary"]["num_succeeded"] for run in system["runs"])
        num_sent = sum(run["summary"]["num_sent"] for run in system["runs"])
        cells = [system["name"], f"{num_ok}/{num_sent}"] + metric_cells(medians, METRICS)
        if ratio_rows:
            peer = by_peer.get(system["name"], {})
            cells += [ratio_cell(peer.get(key)) for key, _header in RATIO_METRICS]
        rows.append(cells)
    return markdown_table(header, rows)
