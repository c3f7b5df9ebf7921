"""The load-latency figure: one curve per system, repetitions as a median with a min-max bar.

Panels: Neo's mean per-token latency (section 5.2, Figure 6), TTFT (p50 solid, p99 dashed),
and output throughput, each against the offered load (request rate or concurrency).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_LABELLED_LOADS = 12

# (title, y label, how to read the value from a run summary, line style)
_PANELS = (
    ("Per-token latency (Neo)", "mean latency / output token (s)",
     ((lambda s: s["per_token_latency"]["mean"], "-", ""),)),
    ("Time to first token", "TTFT (s)",
     ((lambda s: s["ttft"]["p50"], "-", " p50"), (lambda s: s["ttft"]["p99"], "--", " p99"))),
    ("Output throughput", "tokens/s", ((lambda s: s["output_throughput"], "-", ""),)),
)


def load_x(run: dict) -> float | None:
    """The x of a run: the offered load, or for burst and raw replay the achieved request rate."""
    value = run["load"]["value"]
    return value if value is not None else run["summary"]["request_throughput"]


def plot_load_latency(results: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    kind = results["load_kind"]
    x_label = {"rate": "offered request rate (req/s)", "concurrency": "concurrent clients"}.get(
        kind, "achieved request rate (req/s)")
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(5.2 * len(_PANELS), 4.2), constrained_layout=True)
    for system_index, system in enumerate(results["systems"]):
        color = f"C{system_index}"
        for ax, (_title, _ylabel, series) in zip(axes, _PANELS):
            for read, style, suffix in series:
                xs, medians, lows, highs = _points(system["runs"], read)
                if not xs:
                    continue
                ax.errorbar(xs, medians, yerr=[np.subtract(medians, lows), np.subtract(highs, medians)],
                            color=color, linestyle=style, marker="o", markersize=4, capsize=3,
                            label=system["name"] + suffix)
    loads = sorted({run["load"]["value"] for system in results["systems"] for run in system["runs"]
                    if run["load"]["value"] is not None})
    for ax, (title, ylabel, _series) in zip(axes, _PANELS):
        if 0 < len(loads) <= MAX_LABELLED_LOADS:
            ax.set_xticks(loads)  # mark the measured loads, not round numbers between them
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(results.get("title", "serving benchmark"), fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _points(runs: list[dict], read) -> tuple[list, list, list, list]:
    """Median, min and max over repetitions at each load, skipping loads with no value."""
    by_load: dict[float, list[float]] = {}
    for run in runs:
        x, y = load_x(run), read(run["summary"])
        if x is not None and y is not None:
            by_load.setdefault(run["load"]["value"] if run["load"]["value"] is not None else x, []).append(y)
    xs = sorted(by_load)
    return (xs, [float(np.median(by_load[x])) for x in xs], [min(by_load[x]) for x in xs],
            [max(by_load[x]) for x in xs])
