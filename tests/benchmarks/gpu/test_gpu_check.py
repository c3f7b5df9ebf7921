"""benchmarks/gpu/gpu_check.py (`make gpu-check`) without a GPU: a step past its budget is killed, a
failed one reported and the rest still run, missing packages skip a step, the summary and the doc's
blocks; and (slow) the whole script in its quick mode on CPU tensors, the testbed and Triton's
interpreter, producing every table."""
from __future__ import annotations

import sys
import time

import pytest

from benchmarks.gpu import gpu_check
from benchmarks.gpu.gpu_check import Outcome, Step, run_step, summary_markdown, update_doc

REPO_DOC = gpu_check.DOC


def python_step(monkeypatch, code: str, name: str = "fake", budget_s: float = 30, table: bool = False,
                needs: tuple[str, ...] = ()) -> Step:
    """A step that runs `code` in a fresh interpreter instead of a module."""
    monkeypatch.setattr(gpu_check, "command_for", lambda step, quick, results_dir: [sys.executable, "-c", code])
    return Step(name, "unused", (), (), budget_s, needs=needs, table=table)


def test_a_step_past_its_budget_is_killed_with_what_it_started(monkeypatch, tmp_path):
    child = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    step = python_step(monkeypatch, code, budget_s=3)
    start = time.perf_counter()
    outcome = run_step(step, False, tmp_path, 100, tmp_path)
    assert outcome.status == "timed out" and time.perf_counter() - start < 15
    pid = int(child.read_text())
    with pytest.raises(ProcessLookupError):  # the step's own child went with it (its process group)
        for _ in range(50):
            time.sleep(0.1)
            __import__("os").kill(pid, 0)


def test_a_failed_step_reports_the_end_of_its_output(monkeypatch, tmp_path):
    step = python_step(monkeypatch, "import sys; print('the reason it broke'); sys.exit(3)")
    outcome = run_step(step, False, tmp_path, 100, tmp_path)
    assert outcome.status == "failed" and "the reason it broke" in outcome.detail


def test_a_benchmark_that_writes_no_table_has_failed(monkeypatch, tmp_path):
    outcome = run_step(python_step(monkeypatch, "pass", table=True), False, tmp_path, 100, tmp_path)
    assert outcome.status == "failed" and "wrote no fake.md" in outcome.detail


def test_missing_packages_and_a_spent_deadline_skip_a_step(monkeypatch, tmp_path):
    missing = python_step(monkeypatch, "pass", needs=("no_such_package_here",))
    assert run_step(missing, False, tmp_path, 100, tmp_path).detail == "not importable here: no_such_package_here"
    late = run_step(python_step(monkeypatch, "pass"), False, tmp_path, 0.5, tmp_path)
    assert late.status == "skipped" and "deadline" in late.detail


def test_the_steps_cover_the_cuda_tests_and_every_gpu_benchmark():
    names = [step.name for step in gpu_check.steps(("tests",))]
    assert names == ["build", "cuda tests", "triton_w4a16", "decode_step_gpu", "weight_streaming_gpu",
                     "moe_offload_gpu", "neo_gpu"]
    assert sum(step.budget_s for step in gpu_check.steps(("tests",))) <= gpu_check.TOTAL_DEADLINE_S


def test_the_summary_names_the_card_and_each_step():
    outcomes = [Outcome("cuda tests", "passed", 61.2, command="python -m pytest -m cuda"),
                Outcome("neo_gpu", "skipped", detail="the total deadline had passed\nmore", command="python -m x"),
                Outcome("triton_w4a16", "failed", 3.0, "Traceback", "python -m y")]
    summary = summary_markdown(outcomes, "NVIDIA H100 80GB HBM3", 400, 540, ["gemlite"])
    assert summary.startswith("NVIDIA H100 80GB HBM3: `make gpu-check` in 400 s (deadline 540 s)")
    assert "| neo_gpu | skipped (the total deadline had passed) | 0 | - | `python -m x` |" in summary
    assert "| triton_w4a16 | failed | 3 | - | `python -m y` |" in summary


def test_only_the_steps_tables_are_refreshed_in_the_doc(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- bench:neo_gpu -->\nold\n<!-- /bench:neo_gpu -->\n\n"
                   "<!-- bench:int4_matmul -->\nold\n<!-- /bench:int4_matmul -->\n\n## CPU offloading (Neo)\n")
    for name in ("neo_gpu", "int4_matmul", "gpu_check"):
        (tmp_path / f"{name}.md").write_text(f"new {name}\n")
    assert sorted(update_doc(doc, tmp_path, ["neo_gpu", "gpu_check"])) == ["gpu_check", "neo_gpu"]
    text = doc.read_text()
    assert "new neo_gpu" in text and "new int4_matmul" not in text
    assert text.index("<!-- bench:gpu_check -->") < text.index("## CPU offloading (Neo)")


@pytest.mark.slow
def test_the_quick_run_produces_every_table(tmp_path):
    """~2 minutes here: each benchmark's quick size on the CPU, the testbed or the interpreter, the
    CUDA tests of one file collected (and skipped), the tables stamped and put in a copy of the doc."""
    doc = tmp_path / "benchmarks.md"
    doc.write_text(REPO_DOC.read_text())
    code = gpu_check.main(["--quick", "--budget-scale", "4", "--results-dir", str(tmp_path / "results"),
                           "--doc", str(doc), "--test-paths", "tests/kernels/test_triton_w4a16.py"])
    assert code == 0
    text = doc.read_text()
    for name in ("triton_w4a16", "decode_step_gpu", "weight_streaming_gpu", "moe_offload_gpu", "neo_gpu"):
        table = (tmp_path / "results" / f"{name}.md").read_text()
        assert "|---" in table and "Measured on no CUDA device" in table and table.strip() in text
    assert "| neo_gpu | passed |" in (tmp_path / "results" / "gpu_check.md").read_text()
