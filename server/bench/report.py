"""Text output of a serving benchmark: one row per run, ratios against the baseline system."""
from __future__ import annotations

from server.bench.stats import ratio_spread

# (column header, how to read it from a run summary, format); latencies in milliseconds
_COLUMNS = (
    ("ok/sent", lambda s: f"{s['num_succeeded']}/{s['num_sent']}", "{}"),
    ("out tok/s", lambda s: s["output_throughput"], "{:.1f}"),
    ("req/s", lambda s: s["request_throughput"], "{:.2f}"),
    ("lat/tok ms", lambda s: _ms(s["per_token_latency"]["mean"]), "{:.1f}"),
    ("TTFT p50", lambda s: _ms(s["ttft"]["p50"]), "{:.0f}"),
    ("TTFT p99", lambda s: _ms(s["ttft"]["p99"]), "{:.0f}"),
    ("TPOT p50", lambda s: _ms(s["tpot"]["p50"]), "{:.1f}"),
    ("ITL p99", lambda s: _ms(s["itl"]["p99"]), "{:.1f}"),
    ("e2e p50", lambda s: _ms(s["e2e"]["p50"]), "{:.0f}"),
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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def run_table(results: dict) -> str:
    """A markdown table: one row per (system, load, repetition)."""
    header = ["system", "load", "rep"] + [c[0] for c in _COLUMNS] + ["errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system in results["systems"]:
        for run in system["runs"]:
            s = run["summary"]
            cells = [system["name"], run["load"]["label"], str(run["rep"])]
            for _name, read, fmt in _COLUMNS:
                value = read(s)
                cells.append("-" if value is None else fmt.format(value))
            cells.append(", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "-")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['system']} / {row['baseline']}", row["load"]]
        for name in names:
            r = row["metrics"].get(name)
            cells.append("-" if r is None else
                         f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r["n"] > 1 else f"{r['median']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
