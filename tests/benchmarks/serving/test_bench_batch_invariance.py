"""benchmarks/serving/batch_invariance.py at a tiny size: both engines measured, interleaved, and
the table gives each rate's ratio."""
from benchmarks.serving import batch_invariance


def test_both_modes_are_measured_and_compared(monkeypatch, tmp_path):
    monkeypatch.setattr(batch_invariance, "RESULTS", tmp_path / "batch_invariance.json")
    monkeypatch.setattr(batch_invariance, "PROMPT_TOKENS", (24,))
    monkeypatch.setattr(batch_invariance, "DECODE_TOKENS", 3)
    batch_invariance.main(["--reps", "2"])
    markdown = (tmp_path / "batch_invariance.md").read_text()
    assert "| prefill, 24-token prompt |" in markdown and "| decode, 8 sequence(s) |" in markdown
    assert markdown.count("x |") == 3
