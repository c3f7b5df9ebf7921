"""Text output of the serving benchmarks: serve's table (one row per run, ratios against the
baseline system) and the helpers multi_turn's and long_prompt's tables share (a metric per column,
medians over repetitions)."""
from __future__ import annotations

import statistics
from typing import Callable

from benchmarks.load.stats import ratio_spread

Reader = Callable[[dict], "float | None"]
# (key, column header, reader of a run, format)
Metric = tuple[str, str, Reader, str]

# (column header, how to read it from a run summary, format); latencies in milliseconds
_COLUMNS = (
    ("ok/sent", lambda s: f"{s['num_succeeded']}/{s['num_sent']}", "{}"),
    ("out tok/s", lambda s: s["output_throughput"], "{:.1f}"),
    ("req/s", lambda s: s["request_throughput"], "{:.2f}"),
    ("lat/tok ms", lambda s: ms(s["per_token_latency"]["mean"]), "{:.1f}"),
    ("TTFT p50", lambda s: ms(s["ttft"]["p50"]), "{:.0f}"),
    ("TTFT p99", lambda s: ms(s["ttft"]["p99"]), "{:.0f}"),
    ("TPOT p50", lambda s: ms(s["tpot"]["p50"]), "{:.1f}"),
    ("ITL p99", lambda s: ms(s["itl"]["p99"]), "{:.1f}"),
    ("e2e p50", lambda s: ms(s["e2e"]["p50"]), "{:.0f}"),
    ("goodput", lambda s: s["goodput"] if s["slos"] else None, "{:.2f}"),
)

# Metrics compared between systems: (name, reader, higher is better)
RATIO_METRICS = (
    ("output_throughput", lambda s: s["output_throughput"], True),
    ("request_throughput", lambda s: s["request_throughput"], True),
    ("goodput", lambda s: s["goodput"] if s["slos"] else None, True),
    ("mean_per_token_latency", lambda s: s["per_token_latency"]["mean"], False),
    ("p50_per_token_latency", lambda s: s["per_token_latency"]["p50"], False),
    ("p50_ttft", lambda s: s["ttft"]["p50"], False),
    ("p99_ttft", lambda s: s["ttft"]["p99"], False),
    ("p50_tpot", lambda s: s["tpot"]["p50"], False),
)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def run_metrics(run: dict, metrics: tuple[Metric, ...]) -> dict[str, float | None]:
    return {key: read(run) for key, _header, read, _fmt in metrics}


def median_metrics(runs: list[dict], metrics: tuple[Metric, ...]) -> dict[str, float | None]:
    """Each metric's median over the runs that have it; None where none does."""
    rows = [run_metrics(run, metrics) for run in runs]
    medians = {}
    for key, *_ in metrics:
        values = [row[key] for row in rows if row[key] is not None]
        medians[key] = statistics.median(values) if values else None
    return medians


def metric_cells(medians: dict[str, float | None], metrics: tuple[Metric, ...]) -> list[str]:
    """Each metric's median formatted for its column, "-" where there is none."""
    return ["-" if medians[key] is None else fmt.format(medians[key]) for key, _h, _r, fmt in metrics]


def run_table(results: dict) -> str:
    """A markdown table: one row per (system, load, repetition)."""
    header = ["system", "load", "rep"] + [c[0] for c in _COLUMNS] + ["errors"]
    rows = []
    for system in results["systems"]:
        for run in system["runs"]:
            s = run["summary"]
            cells = [system["name"], run["load"]["label"], str(run["rep"])]
            for _name, read, fmt in _COLUMNS:
                value = read(s)
                cells.append("-" if value is None else fmt.format(value))
            cells.append(", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "-")
            rows.append(cells)
    return markdown_table(header, rows)


def ratios(results: dict) -> list[dict]:
    """For each non-baseline system and load: per-metric ratio to the baseline (the first system),
    paired by repetition, as median and min-max over repetitions."""
    systems = results["systems"]
    if len(systems) < 2:
        return []
    baseline = systems[0]
    rows = []
    for other in systems[1:]:
        for load_label in dict.fromkeys(run["load"]["label"] for run in baseline["runs"]):
            base_runs = {r["rep"]: r["summary"] for r in baseline["runs"] if r["load"]["label"] == load_label}
            other_runs = {r["rep"]: r["summary"] for r in other["runs"] if r["load"]["label"] == load_label}
            reps = sorted(set(base_runs) & set(other_runs))
            row = {"system": other["name"], "baseline": baseline["name"], "load": load_label, "metrics": {}}
            for name, read, _higher_is_better in RATIO_METRICS:
                spread = ratio_spread([read(other_runs[r]) for r in reps], [read(base_runs[r]) for r in reps])
                if spread is not None:
                    row["metrics"][name] = spread
            rows.append(row)
    return rows


def ratio_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    names = [m[0] for m in RATIO_METRICS if any(m[0] in r["metrics"] for r in rows)]
    header = ["system / baseline", "load"] + names
    return markdown_table(header, [[f"{row['system']} / {row['baseline']}", row["load"]]
                                   + [ratio_cell(row["metrics"].get(name)) for name in names] for row in rows])


def ratio_cell(spread: dict | None) -> str:
    """A ratio spread (stats.ratio_spread) as `median x [min-max]`, the range only over several."""
    if spread is None:
        return "-"
    if spread["n"] > 1:
        return f"{spread['median']:.2f}x [{spread['min']:.2f}-{spread['max']:.2f}]"
    return f"{spread['median']:.2f}x"
