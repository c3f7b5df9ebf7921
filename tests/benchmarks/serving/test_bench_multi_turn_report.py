"""The multi-turn benchmark's numbers (benchmarks/serving/multi_turn_report.py and summarize_run): turns
split, prefix-cache hit rates, medians over repetitions, tandem/peer ratios and the table."""
from __future__ import annotations

import pytest

from benchmarks.load.client import RequestRecord
from benchmarks.serving.multi_turn import summarize_run
from benchmarks.serving.multi_turn_report import (median_metrics, prefix_cache_stats, ratios, run_metrics, table,
                                            usage_cached_stats)


def record(index: int, start_s: float, ttft_s: float, num_tokens: int = 3, itl_s: float = 0.1) -> RequestRecord:
    times = [start_s + ttft_s + i * itl_s for i in range(num_tokens)]
    return RequestRecord(index, 10, num_tokens, start_s=start_s, end_s=times[-1], token_times_s=times,
                         num_prompt_tokens=10, num_output_tokens=num_tokens, usage_reported=True)


def conversations(first_ttft_s: float, later_ttft_s: float) -> list[list[RequestRecord]]:
    """Two conversations of two turns, the second turn starting when the first ends."""
    out = []
    for c in range(2):
        first = record(2 * c, 0.0, first_ttft_s)
        out.append([first, record(2 * c + 1, first.end_s, later_ttft_s)])
    return out


def run(rep: int, first_ttft_s: float, later_ttft_s: float, counters: dict | None = None) -> dict:
    return {**summarize_run(conversations(first_ttft_s, later_ttft_s)), "rep": rep,
            "server_counters": counters, "prefix_cache": prefix_cache_stats(counters)}


def test_first_and_later_turns_are_summarized_apart():
    summary = summarize_run(conversations(first_ttft_s=1.0, later_ttft_s=0.2))
    assert summary["summary"]["num_succeeded"] == 4
    assert summary["first_turn"]["ttft"]["p50"] == pytest.approx(1.0)
    assert summary["later_turns"]["ttft"]["p50"] == pytest.approx(0.2)
    assert summary["summary"]["ttft"]["p50"] == pytest.approx(0.6)  # between the two pairs
    # 12 tokens from t=0 to the second turns' ends: (1.0 + 0.2) + (0.2 + 0.2) = 1.6 s
    assert summary["summary"]["output_throughput"] == pytest.approx(12 / 1.6)
    assert summary["summary"]["request_throughput"] == pytest.approx(4 / 1.6)


def test_a_conversation_cut_short_leaves_its_unsent_turns_out_of_the_latencies():
    turns = conversations(1.0, 0.2)
    turns[1][1] = RequestRecord(3, 10, 3)  # never sent
    summary = summarize_run(turns)
    assert (summary["summary"]["num_requests"], summary["summary"]["num_sent"]) == (4, 3)
    assert summary["later_turns"]["num_succeeded"] == 1


def test_prefix_cache_hit_rate_overall_and_per_tier():
    # tandem: 160 prompt tokens queried in the GPU pool, its 20 misses of them again in the host pool
    stats = prefix_cache_stats({"prefix_cache_queries": 180.0, "prefix_cache_hits": 150.0,
                                "prefix_cache_queries:gpu": 160.0, "prefix_cache_hits:gpu": 140.0,
                                "prefix_cache_queries:cpu": 20.0, "prefix_cache_hits:cpu": 10.0,
                                "prompt_tokens": 160.0})
    assert stats["hit_rate"] == pytest.approx(150 / 160)
    assert stats["by_tier"] == {"cpu": pytest.approx(0.5), "gpu": pytest.approx(0.875)}
    assert prefix_cache_stats({"prefix_cache_queries": 200.0, "prefix_cache_hits": 50.0})["hit_rate"] == 0.25  # vLLM
    assert prefix_cache_stats({"prompt_tokens": 5.0}) is None  # llama.cpp: no prefix-cache counters
    assert prefix_cache_stats(None) is None
    assert prefix_cache_stats({"prefix_cache_queries": 0.0})["hit_rate"] is None


def test_cached_share_from_usage_counts_only_requests_that_report_it():
    turns = conversations(1.0, 0.2)
    assert usage_cached_stats([r for t in turns for r in t]) is None  # tandem's usage says nothing
    turns[0][1].num_cached_prompt_tokens, turns[1][1].num_cached_prompt_tokens = 8, 6
    turns[1][0].num_cached_prompt_tokens = 0
    stats = summarize_run(turns)["usage_cached"]
    assert (stats["num_requests"], stats["num_prompt_tokens"], stats["num_cached_tokens"]) == (3, 30, 14)
    assert stats["fraction"] == pytest.approx(14 / 30)


def test_medians_over_repetitions_skip_missing_values():
    runs = [run(0, 1.0, 0.2), run(1, 3.0, 0.4, {"prefix_cache_queries": 10.0, "prefix_cache_hits": 5.0}),
            run(2, 2.0, 0.3)]
    medians = median_metrics(runs)
    assert medians["first_turn_ttft_p50"] == pytest.approx(2000.0)  # milliseconds
    assert medians["later_turns_ttft_p50"] == pytest.approx(300.0)
    assert medians["prefix_cache_hit_rate"] == pytest.approx(0.5)  # the one run that had it
    assert median_metrics([run(0, 1.0, 0.2)])["prefix_cache_hit_rate"] is None
    assert run_metrics(runs[0])["itl_p50"] == pytest.approx(100.0)


def test_ratios_are_tandem_over_each_peer_paired_by_repetition():
    tandem = {"name": "tandem", "runs": [run(0, 1.0, 0.1), run(1, 1.0, 0.1)]}
    peer = {"name": "peer", "runs": [run(1, 2.0, 0.4), run(0, 4.0, 0.4)]}  # runs in any order
    (row,) = ratios([tandem, peer])
    assert (row["system"], row["baseline"]) == ("peer", "tandem")
    later = row["metrics"]["later_turns_ttft_p50"]
    assert later["median"] == pytest.approx(0.25) and later["n"] == 2
    # the same tokens in tandem's 1.5 s run against the peer's 4.8 s (rep 0) and 2.8 s (rep 1)
    throughput = row["metrics"]["output_throughput"]
    assert (throughput["min"], throughput["max"]) == (pytest.approx(2.8 / 1.5), pytest.approx(4.8 / 1.5))
    assert ratios([tandem]) == []


def test_table_has_a_row_per_system_with_its_ratio_cells():
    tandem = {"name": "tandem", "runs": [run(0, 1.0, 0.1, {"prefix_cache_queries": 4.0, "prefix_cache_hits": 3.0})]}
    peer = {"name": "llama.cpp", "runs": [run(0, 2.0, 0.4)]}
    text = table([tandem, peer], ratios([tandem, peer]))
    header, rule, tandem_row, peer_row = text.splitlines()
    assert "tandem/this TTFT p50" in header and header.count("|") == rule.count("|")
    assert tandem_row.startswith("| tandem | 4/4 |") and "| 75% |" in tandem_row
    assert tandem_row.endswith("| - | - | - |")
    assert "| 0.25x |" in peer_row and "| - |" in peer_row  # no prefix-cache counters
    assert "tandem/this" not in table([tandem], [])
