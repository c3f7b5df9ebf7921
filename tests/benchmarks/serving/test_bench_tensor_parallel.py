"""benchmarks/serving/tensor_parallel.py end to end, one repetition of one stream, into a scratch results file."""
import json

import pytest

import benchmarks.serving.tensor_parallel as bench

pytestmark = pytest.mark.tp


def test_one_rank_against_two_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "tensor_parallel.json")
    monkeypatch.setattr(bench, "OUTPUT_TOKENS", 8)
    assert bench.main(["--reps", "1", "--streams", "1"]) == 0
    rows = json.loads((tmp_path / "tensor_parallel.json").read_text())["rows"]
    assert set(rows) == {"tp1 x1", "tp2 x1"}
    assert all(row["tokens_per_s"] > 0 and row["step_overhead_ms"] >= 0 for row in rows.values())
    table = (tmp_path / "tensor_parallel.md").read_text()
    assert table.startswith("| streams | tp 1 tokens/s | tp 2 tokens/s |") and "| 1 |" in table
