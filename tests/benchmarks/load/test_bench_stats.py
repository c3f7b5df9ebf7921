"""Statistics of the serving benchmark on synthetic timings (no server, no model)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.load.client import RequestRecord
from benchmarks.load.stats import distribution, meets_slos, ratio_spread, request_latency, summarize


def record(index=0, start=0.0, token_times=(), end=None, num_output=None, num_prompt=10, error=None,
           scheduled=None) -> RequestRecord:
    """A finished request: sent at `start`, tokens at `token_times`, usage as given."""
    token_times = list(token_times)
    return RequestRecord(index, num_prompt, num_output or len(token_times), scheduled_s=scheduled, start_s=start,
                         end_s=end if end is not None else (token_times[-1] if token_times else start),
                         token_times_s=token_times, num_prompt_tokens=num_prompt,
                         num_output_tokens=num_output if num_output is not None else len(token_times),
                         usage_reported=True, error=error)


def test_request_latency_definitions():
    r = record(start=1.0, token_times=[1.5, 1.7, 2.0, 2.5], end=2.5)
    lat = request_latency(r)
    assert lat.ttft == pytest.approx(0.5)
    assert lat.e2e == pytest.approx(1.5)
    assert lat.tpot == pytest.approx((1.5 - 0.5) / 3)
    assert lat.per_token_latency == pytest.approx(1.5 / 4)  # Neo: latency / output tokens
    assert lat.itls == pytest.approx((0.2, 0.3, 0.5))


def test_tpot_uses_usage_tokens_not_chunks():
    # two chunks carried 6 tokens (a server may batch deltas): TPOT divides by usage's count
    r = record(start=0.0, token_times=[1.0, 2.0], end=2.0, num_output=6)
    lat = request_latency(r)
    assert lat.tpot == pytest.approx(1.0 / 5)
    assert lat.per_token_latency == pytest.approx(2.0 / 6)


def test_single_token_output_has_no_tpot():
    lat = request_latency(record(start=0.0, token_times=[0.4], end=0.4))
    assert lat.tpot is None and lat.itls == ()
    assert lat.per_token_latency == pytest.approx(0.4)


def test_distribution_matches_numpy_linear_percentiles():
    rng = np.random.default_rng(7)
    values = list(rng.lognormal(size=501))
    d = distribution(values)
    assert d["mean"] == pytest.approx(np.mean(values))
    for p in (50, 90, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(values, p))
    # hand-checked: 1..10 -> p50 5.5, p90 9.1, p99 9.91
    d = distribution([float(x) for x in range(1, 11)])
    assert (d["p50"], d["p90"], d["p99"]) == pytest.approx((5.5, 9.1, 9.91))
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_meets_slos_ignores_undefined_metrics():
    lat = request_latency(record(start=0.0, token_times=[0.3], end=0.3))
    assert meets_slos(lat, {"ttft": 0.5, "tpot": 0.001})  # no TPOT for a single token
    assert not meets_slos(lat, {"ttft": 0.2})
    assert meets_slos(lat, {})


def test_summarize_throughputs_goodput_and_errors():
    records = [
        record(0, start=0.0, token_times=[0.1, 0.2, 0.3], end=0.3, num_prompt=5),   # fast: meets SLOs
        record(1, start=0.5, token_times=[1.5, 1.6, 1.7], end=2.0, num_prompt=7),   # TTFT 1.0 misses
        record(2, start=1.0, end=1.2, error="429"),
        RequestRecord(3, 4, 4),                                                    # never sent
    ]
    records[2].token_times_s, records[2].num_output_tokens = [], None
    s = summarize(records, {"ttft": 0.5})
    assert (s["num_requests"], s["num_sent"], s["num_succeeded"], s["num_failed"]) == (4, 3, 2, 1)
    assert s["errors"] == {"429": 1}
    assert s["first_error"].startswith("429")
    assert s["duration_s"] == pytest.approx(2.0)  # first send 0.0 to last end 2.0
    assert s["num_output_tokens"] == 6 and s["num_prompt_tokens"] == 12
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(9.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["goodput"] == pytest.approx(0.5)
    assert s["goodput_fraction"] == pytest.approx(0.5)
    assert s["ttft"]["p50"] == pytest.approx(0.55)
    assert s["per_token_latency"]["mean"] == pytest.approx((0.3 / 3 + 1.5 / 3) / 2)
    assert s["itl"]["mean"] == pytest.approx(0.1)


def test_summarize_send_lag_and_unknown_slo():
    records = [record(0, start=0.02, token_times=[0.1], scheduled=0.0),
               record(1, start=1.05, token_times=[1.2], scheduled=1.0)]
    assert summarize(records)["max_send_lag_s"] == pytest.approx(0.05)
    with pytest.raises(ValueError, match="latency"):
        summarize(records, {"latency": 1.0})


def test_summarize_nothing_succeeded():
    s = summarize([record(0, start=0.0, end=0.1, error="500")])
    assert s["num_succeeded"] == 0 and s["goodput_fraction"] is None
    assert s["ttft"]["p50"] is None and s["output_throughput"] == 0.0


def test_ratio_spread_pairs_repetitions():
    r = ratio_spread([2.0, 3.0, 4.5], [1.0, 2.0, 3.0])
    assert r == {"median": pytest.approx(1.5), "min": pytest.approx(1.5), "max": pytest.approx(2.0), "n": 3}
    assert ratio_spread([1.0, None], [0.0, 1.0]) is None
    assert math.isclose(ratio_spread([1.0], [4.0])["median"], 0.25)
