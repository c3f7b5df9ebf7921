"""benchmarks/gpu/neo_gpu.py without a GPU: its workload and its table (docs/benchmarks.md's neo_gpu block)."""
import json

import pytest

from benchmarks.gpu.neo_gpu import RESULTS, make_workload, to_markdown


def test_workload_is_seeded_and_within_its_spreads():
    workload = make_workload(50, 240, 0.1, 320, 0.6, vocab_size=1000, seed=0)
    assert workload == make_workload(50, 240, 0.1, 320, 0.6, vocab_size=1000, seed=0)
    assert workload != make_workload(50, 240, 0.1, 320, 0.6, vocab_size=1000, seed=1)
    for prompt, output_len in workload:
        assert 216 <= len(prompt) <= 264 and all(0 <= t < 1000 for t in prompt)
        assert 128 <= output_len <= 512
    assert len({n for _, n in workload}) > 10  # spread, not one length


@pytest.mark.skipif(not RESULTS.exists(), reason="no GPU result recorded")
def test_recorded_table_is_what_the_recorded_runs_give():
    result = json.loads(RESULTS.read_text())
    assert to_markdown(result) == RESULTS.with_suffix(".md").read_text()
    for case in result["cases"]:
        pairs = zip(case["runs"]["tandem"], case["runs"]["gpu-only"])
        ratios = [t["output_tokens_per_s"] / g["output_tokens_per_s"] for t, g in pairs]
        assert case["throughput_ratios"] == pytest.approx(ratios)
