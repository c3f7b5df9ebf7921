"""The long-prompt benchmark's numbers: the running streams' inter-token gaps before and while the
long prompt is prefilled, their TPOT, medians over repetitions, and the table.

Two windows on a run's clock (seconds), both about the running streams only:
  before  from the moment every stream has its first token until the long prompt is sent: the
          streams decoding among themselves, the reference
  during  from the long prompt's send until its first token: while a server prefills it
A gap is the time between two successive token events of one stream. It counts in `before` when it
lies wholly inside, and in `during` when it overlaps the window at all: a server that prefills the
prompt in one iteration may decode the streams only after it, so the gap that holds the stall ends
after the long prompt's first token, and leaving it out would hide the stall. The target is
during-window ITL p99 / TPOT p50 at most 3, TPOT over each stream's whole run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from benchmarks.load import report
from benchmarks.load.client import RequestRecord
from benchmarks.load.report import Metric, Reader, markdown_table, metric_cells, ms
from benchmarks.load.stats import summarize

ITL_P99_OVER_TPOT_TARGET = 3.0


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float


def token_gaps(token_times_s: Sequence[float]) -> list[tuple[float, float]]:
    """(start, end) of each gap between successive token events."""
    return list(zip(token_times_s, token_times_s[1:]))


def gaps_within(token_times_s: Sequence[float], window: Window) -> list[float]:
    """The lengths of the gaps that lie wholly inside `window`."""
    return [end - start for start, end in token_gaps(token_times_s)
            if start >= window.start_s and end <= window.end_s]


def gaps_overlapping(token_times_s: Sequence[float], window: Window) -> list[float]:
    """The lengths of the gaps that overlap `window` (a gap only touching an edge does not)."""
    return [end - start for start, end in token_gaps(token_times_s)
            if start < window.end_s and end > window.start_s]


def before_window(streams: list[RequestRecord], long: RequestRecord) -> Window | None:
    """Every stream's first token to the long prompt's send; None when some stream has no token
    by then or the long prompt was never sent."""
    if long.start_s is None or any(not r.token_times_s for r in streams):
        return None
    start_s = max(r.token_times_s[0] for r in streams)
    return Window(start_s, long.start_s) if start_s < long.start_s else None


def during_window(long: RequestRecord) -> Window | None:
    """The long prompt's send to its first token; None when it has none."""
    if long.start_s is None or not long.token_times_s:
        return None
    return Window(long.start_s, long.token_times_s[0])


def itl_stats(gaps_s: list[float]) -> dict[str, float | int | None]:
    """p50, p99 (linear interpolation between order statistics, as stats.distribution) and max."""
    if not gaps_s:
        return {"num_gaps": 0, "p50": None, "p99": None, "max": None}
    gaps = np.asarray(gaps_s, dtype=float)
    return {"num_gaps": len(gaps_s), "p50": float(np.percentile(gaps, 50)), "p99": float(np.percentile(gaps, 99)),
            "max": float(gaps.max())}


def window_stats(streams: list[RequestRecord], window: Window | None,
                 gaps: Callable[[Sequence[float], Window], list[float]]) -> dict | None:
    """The window and the ITLs of every stream's gaps in it (`gaps` decides which count)."""
    if window is None:
        return None
    pooled = [gap for r in streams for gap in gaps(r.token_times_s, window)]
    return {"start_s": window.start_s, "end_s": window.end_s, "itl": itl_stats(pooled)}


def num_streams_through(streams: list[RequestRecord], window: Window | None) -> int | None:
    """The streams that still produced a token at or after the window's end: those that were
    running for the whole window."""
    if window is None:
        return None
    return sum(bool(r.token_times_s) and r.token_times_s[-1] >= window.end_s for r in streams)


def summarize_run(streams: list[RequestRecord], long: RequestRecord) -> dict:
    """One run: `summarize` rows for the streams and the long prompt, both windows' ITLs."""
    during = during_window(long)
    return {"streams": summarize(streams), "long_prompt": summarize([long]),
            "before": window_stats(streams, before_window(streams, long), gaps_within),
            "during": window_stats(streams, during, gaps_overlapping),
            "num_streams_through_window": num_streams_through(streams, during)}


def _window_itl(window: str, stat: str) -> Reader:
    return lambda run: ms((run[window] or {}).get("itl", {}).get(stat))


def itl_p99_over_tpot(run: dict) -> float | None:
    """The during-window ITL p99 over the streams' TPOT p50: how many decode steps' worth the worst
    stall is."""
    itl_p99 = ((run["during"] or {}).get("itl") or {}).get("p99")
    tpot_p50 = run["streams"]["tpot"]["p50"]
    return itl_p99 / tpot_p50 if itl_p99 is not None and tpot_p50 else None


# (key, column header, reader of a run, format); latencies in milliseconds, the TTFT in seconds
METRICS: tuple[Metric, ...] = (
    ("long_ttft_s", "long prompt TTFT s", lambda run: run["long_prompt"]["ttft"]["p50"], "{:.2f}"),
    ("before_itl_p50", "before: ITL p50 ms", _window_itl("before", "p50"), "{:.1f}"),
    ("before_itl_p99", "before: ITL p99 ms", _window_itl("before", "p99"), "{:.1f}"),
    ("during_itl_p50", "during: ITL p50 ms", _window_itl("during", "p50"), "{:.1f}"),
    ("during_itl_p99", "during: ITL p99 ms", _window_itl("during", "p99"), "{:.1f}"),
    ("during_itl_max", "during: ITL max ms", _window_itl("during", "max"), "{:.1f}"),
    ("tpot_p50", "TPOT p50 ms", lambda run: ms(run["streams"]["tpot"]["p50"]), "{:.1f}"),
    ("itl_p99_over_tpot", f"ITL p99 / TPOT p50 (target <= {ITL_P99_OVER_TPOT_TARGET:g})", itl_p99_over_tpot,
     "{:.2f}"),
)


def run_metrics(run: dict) -> dict[str, float | None]:
    return report.run_metrics(run, METRICS)


def median_metrics(runs: list[dict]) -> dict[str, float | None]:
    """Each metric's median over the runs that have it; None where none does."""
    return report.median_metrics(runs, METRICS)


def table(systems: list[dict]) -> str:
    """One markdown row per system: medians over repetitions; `ok/sent` counts every request of
    every repetition, `streams through` the fewest streams that ran through a during-window."""
    header = ["system", "ok/sent", "streams through"] + [m[1] for m in METRICS]
    rows = []
    for system in systems:
        runs = system["runs"]
        medians = median_metrics(runs)
        num_ok = sum(run["streams"]["num_succeeded"] + run["long_prompt"]["num_succeeded"] for run in runs)
        num_sent = sum(run["streams"]["num_sent"] + run["long_prompt"]["num_sent"] for run in runs)
        through = [run["num_streams_through_window"] for run in runs if run["num_streams_through_window"] is not None]
        num_streams = max((run["streams"]["num_requests"] for run in runs), default=0)
        cells = [system["name"], f"{num_ok}/{num_sent}", f"{min(through)}/{num_streams}" if through else "-"]
        rows.append(cells + metric_cells(medians, METRICS))
    return markdown_table(header, rows)
