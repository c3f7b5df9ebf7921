"""Per-request latencies and their aggregates, from RequestRecords (no I/O here).

Definitions (seconds):
  TTFT               first token event - send
  ITL                gaps between successive token events (pooled over requests)
  TPOT               (e2e - TTFT) / (output tokens - 1); undefined for one-token outputs
  e2e                last byte - send
  per-token latency  e2e / output tokens, Neo's load-latency metric (section 5.2, Figure 6)
Throughputs divide by the run's span, from the first send to the last completion.
Goodput counts the successful requests that meet every given SLO (DistServe's definition).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from benchmarks.load.client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e", "per_token_latency")


@dataclass(frozen=True)
class RequestLatency:
    ttft: float | None
    tpot: float | None
    e2e: float
    per_token_latency: float | None
    itls: tuple[float, ...]


def request_latency(record: RequestRecord) -> RequestLatency:
    """The latencies of one successful request."""
    e2e = record.end_s - record.start_s
    times = record.token_times_s
    ttft = times[0] - record.start_s if times else None
    num_output = record.num_output_tokens or 0
    tpot = (e2e - ttft) / (num_output - 1) if ttft is not None and num_output > 1 else None
    per_token = e2e / num_output if num_output > 0 else None
    itls = tuple(float(b - a) for a, b in zip(times, times[1:]))
    return RequestLatency(ttft, tpot, e2e, per_token, itls)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation between order statistics), None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES}}


def meets_slos(latency: RequestLatency, slos: dict[str, float]) -> bool:
    """True when every SLO holds; a metric a request does not define (TPOT of one token) holds."""
    for name, limit in slos.items():
        value = getattr(latency, name)
        if value is not None and value > limit:
            return False
    return True


def summarize(records: list[RequestRecord], slos: dict[str, float] | None = None) -> dict:
    """The aggregate row of one run (JSON-ready)."""
    slos = slos or {}
    unknown = set(slos) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metrics {sorted(unknown)}; known: {SLO_METRICS}")
    sent = [r for r in records if r.start_s is not None]
    ok = [r for r in sent if r.ok]
    latencies = [request_latency(r) for r in ok]
    span = _span(sent)
    num_output = sum(r.num_output_tokens or 0 for r in ok)
    num_prompt = sum(r.num_prompt_tokens or 0 for r in ok)
    num_good = sum(meets_slos(lat, slos) for lat in latencies)

    def rate(amount: float) -> float | None:
        return amount / span if span > 0 else None

    return {
        "num_requests": len(records),
        "num_sent": len(sent),
        "num_succeeded": len(ok),
        "num_failed": len(sent) - len(ok),
        "errors": dict(Counter(r.error or "unfinished" for r in sent if not r.ok)),
        "first_error": next((f"{r.error}: {r.error_message}" for r in sent if r.error), None),
        "usage_reported": all(r.usage_reported for r in ok) if ok else None,
        "duration_s": span,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(num_output),
        "total_token_throughput": rate(num_output + num_prompt),
        "slos": slos,
        "goodput": rate(num_good),
        "goodput_fraction": num_good / len(ok) if ok else None,
        "max_send_lag_s": max((r.start_s - r.scheduled_s for r in sent if r.scheduled_s is not None),
                              default=None),
        "ttft": distribution([x.ttft for x in latencies if x.ttft is not None]),
        "tpot": distribution([x.tpot for x in latencies if x.tpot is not None]),
        "itl": distribution([itl for x in latencies for itl in x.itls]),
        "e2e": distribution([x.e2e for x in latencies]),
        "per_token_latency": distribution([x.per_token_latency for x in latencies
                                           if x.per_token_latency is not None]),
    }


def _span(sent: list[RequestRecord]) -> float:
    if not sent:
        return 0.0
    ends = [r.end_s for r in sent if r.end_s is not None]
    last = max(ends) if ends else max(r.start_s for r in sent)
    return last - min(r.start_s for r in sent)


def ratio_spread(values: list[float | None], baselines: list[float | None]) -> dict | None:
    """Pairwise ratios value/baseline over repetitions: median, min, max and the count."""
    ratios = [v / b for v, b in zip(values, baselines) if v is not None and b]
    if not ratios:
        return None
    return {"median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
