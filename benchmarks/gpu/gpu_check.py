"""`make gpu-check`: every CUDA test and each GPU benchmark in one short window, their tables written
into docs/benchmarks.md, so that a few minutes on a lent GPU measure everything.

Steps, in order, each a subprocess of this interpreter with its own time budget under one total
deadline (a slow step is killed at its budget, a failed one reported; the rest still run):

  build            the C++ CPU kernels (skipped where the built module is newer than its sources)
  cuda tests       pytest -m cuda: the Triton kernels compiled, copy streams, CUDA graphs, parity
  triton_w4a16     the W4A16 kernels against dense bf16, torch's int4 matmul and gemlite where importable
  decode_step_gpu  a decode step eager and as a CUDA graph (Llama-3.1-8B's shape)
  weight_streaming_gpu  layers streamed from pinned host memory: the achieved rate against a bare
                   pinned copy, pipelined against copy-then-compute
  moe_offload_gpu  the hot-expert cache against static slicing (Zipf routing)
  neo_gpu          Neo against GPU-only with the capped pool

Each benchmark's table gets a line naming the card and the command, then its block in the doc is
refreshed; a summary table (results/gpu_check.md, its own block) says what ran, passed or failed
and in how long. Missing optional packages (triton, pytest, gemlite, ...) skip or shrink the steps
that need them, with the reason in the summary; nothing is installed (the GPU machine may be offline).

    python3 -m benchmarks.gpu.gpu_check [--deadline-s 540] [--only STEP ...]
    python -m benchmarks.gpu.gpu_check --quick --results-dir DIR --doc FILE   (no GPU: CPU tensors,
        the testbed, Triton's interpreter; tiny sizes; what tests/benchmarks/test_gpu_check.py runs)
"""
from __future__ import annotations

import argparse
import importlib.util
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import REPO, RESULTS_DIR
from benchmarks.update_benchmarks_doc import DOC, add_sections, refresh

TOTAL_DEADLINE_S = 540  # the window: 9 minutes on an H100, all steps together
LOG_TAIL_CHARS = 2000  # of a failed step's output, echoed in the summary
# What the engine imports at start; the others (ray, xgrammar, the server's) only some tests need.
ENGINE_MODULES = ("torch", "numpy", "safetensors", "gguf", "tokenizers", "transformers", "yaml", "pydantic")
OPTIONAL_MODULES = ("triton", "pytest", "gemlite", "xgrammar", "ray", "fastapi", "uvicorn", "openai", "matplotlib")


@dataclass(frozen=True)
class Step:
    """One thing gpu-check runs: `python -m <module> <args>` for a GPU, `quick_args` without one."""

    name: str  # also the results/<name>.md a benchmark writes (None for `table` where it writes none)
    module: str
    gpu_args: tuple[str, ...]
    quick_args: tuple[str, ...]
    budget_s: float  # on a GPU; a step never runs past the total deadline either
    needs: tuple[str, ...] = ENGINE_MODULES
    table: bool = True  # writes results/<name>.md (its block in the doc)
    output_flag: str = "--output"  # how it is told where its JSON goes


def steps(test_paths: tuple[str, ...]) -> list[Step]:
    """The steps in order, most wanted first: a deadline cuts the last ones."""
    return [
        Step("build", "kernels.cpu.build", (), (), 90, needs=("pybind11",), table=False),
        Step("cuda tests", "pytest", ("-m", "cuda", "-rs", "-q", "-p", "no:cacheprovider", *test_paths),
             ("-m", "cuda", "-q", "-p", "no:cacheprovider", *test_paths), 120,
             needs=(*ENGINE_MODULES, "pytest", "triton"), table=False),
        Step("triton_w4a16", "benchmarks.kernels.triton_w4a16", ("--rounds", "2"), ("--quick", "--device", "cpu"),
             60, needs=(*ENGINE_MODULES, "triton")),
        Step("decode_step_gpu", "benchmarks.gpu.decode_step_gpu", ("--batches", "1", "16", "--steps", "10"),
             ("--quick", "--device", "cpu"), 60),
        Step("weight_streaming_gpu", "benchmarks.offload.weight_streaming",
             ("--device", "cuda", "--tiers", "host", "--model", "llama-3.1-8b", "--weights-gpu-gib", "9",
              "--prompt-len-host", "1", "--reps", "2", "--forwards", "3", "--max-model-len", "64"),
             ("--quick", "--device", "testbed"), 75),
        Step("moe_offload_gpu", "benchmarks.offload.moe_offload",
             ("--device", "cuda", "--reps", "1", "--streams", "1", "8", "--window-tokens", "256",
              "--shift-windows", "0", "--no-plot"), ("--quick", "--device", "testbed", "--no-plot"), 60),
        Step("neo_gpu", "benchmarks.gpu.neo_gpu", ("--cases", "capped", "--reps", "2", "--num-requests", "16"),
             ("--quick", "--device", "testbed"), 75),
    ]


@dataclass
class Outcome:
    name: str
    status: str  # passed, failed, timed out, skipped
    seconds: float = 0.0
    detail: str = ""  # why skipped or failed: a reason or the output's tail
    command: str = ""
    tables: list[str] = field(default_factory=list)  # results/<name>.md written


def missing_modules(names: tuple[str, ...]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def device_name(quick: bool) -> str:
    """The card, as torch names it; or what stands in for it in a quick run."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "no CUDA device (quick run: CPU tensors, the testbed, Triton's interpreter)" if quick else "no CUDA device"


def cpu_kernels_up_to_date() -> bool:
    from kernels.cpu import build

    target = build.output_path()
    if not target.exists():
        return False
    sources = [path for pattern in ("*.cpp", "*.h", "build.py") for path in build.HERE.glob(pattern)]
    return all(path.stat().st_mtime <= target.stat().st_mtime for path in sources)


def command_for(step: Step, quick: bool, results_dir: Path) -> list[str]:
    args = list(step.quick_args if quick else step.gpu_args)
    if step.table:
        args += [step.output_flag, str(results_dir / f"{step.name}.json")]
    return [sys.executable, "-m", step.module, *args]


def run_step(step: Step, quick: bool, results_dir: Path, time_left_s: float, log_dir: Path) -> Outcome:
    """Run one step within min(its budget, what the deadline leaves); never raises for the step's own failure."""
    command = command_for(step, quick, results_dir)
    shown = " ".join(["python", *command[1:]]).replace(f"{REPO}/", "")  # paths as from the repository's root
    missing = missing_modules(step.needs)
    if missing:
        return Outcome(step.name, "skipped", detail=f"not importable here: {', '.join(missing)}", command=shown)
    if step.name == "build" and cpu_kernels_up_to_date():
        return Outcome(step.name, "skipped", detail="the built module is newer than its sources", command=shown)
    limit_s = min(step.budget_s, time_left_s)
    if limit_s <= 1:
        return Outcome(step.name, "skipped", detail="the total deadline had passed", command=shown)
    log_path = log_dir / f"{step.name.replace(' ', '_')}.log"
    print(f"gpu-check: {step.name} (up to {limit_s:.0f} s): {shown}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    status = run_with_limit(command, limit_s, log_path)
    seconds = time.perf_counter() - start
    outcome = Outcome(step.name, status, seconds, command=shown)
    if status != "passed":
        outcome.detail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    elif step.table and not (results_dir / f"{step.name}.md").is_file():
        outcome.status, outcome.detail = "failed", f"it exited 0 but wrote no {step.name}.md"
    elif step.table:
        outcome.tables.append(step.name)
    return outcome


def run_with_limit(command: list[str], limit_s: float, log_path: Path) -> str:
    """passed, failed or timed out; output to `log_path`. The step runs in its own process group, so
    that a timeout also ends what it started (engine threads, pytest's subprocesses)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return_code = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "timed out"
    return "passed" if return_code == 0 else "failed"


def stamp_table(results_dir: Path, name: str, card: str, command: str) -> None:
    """The line that says where and how a table was measured, under it."""
    path = results_dir / f"{name}.md"
    path.write_text(f"{path.read_text().rstrip()}\n\nMeasured on {card} by `make gpu-check`: `{command}`\n")


def summary_markdown(outcomes: list[Outcome], card: str, total_s: float, deadline_s: float,
                     missing_optional: list[str]) -> str:
    lines = [f"{card}: `make gpu-check` in {total_s:.0f} s (deadline {deadline_s:.0f} s); "
             f"optional packages not importable: {', '.join(missing_optional) or 'none'}", "",
             "| step | status | seconds | table | command |", "|---|---|---:|---|---|"]
    for outcome in outcomes:
        reason = f" ({first_line(outcome.detail)})" if outcome.status == "skipped" else ""
        lines.append(f"| {outcome.name} | {outcome.status}{reason} | {outcome.seconds:.0f} | "
                     f"{', '.join(outcome.tables) or '-'} | `{outcome.command}` |")
    return "\n".join(lines) + "\n"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def update_doc(doc_path: Path, results_dir: Path, names: list[str]) -> list[str]:
    """Refresh (or add) the blocks of `names` in the doc from `results_dir`; the names refreshed."""
    text, _ = add_sections(doc_path.read_text(), results_dir, names=set(names))
    text, updated = refresh(text, results_dir, names=set(names))
    doc_path.write_text(text)
    return updated


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes on CPU tensors / the testbed / Triton's "
                                                             "interpreter: the script exercised without a GPU")
    parser.add_argument("--deadline-s", type=float, default=TOTAL_DEADLINE_S, help="all steps together")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="each step's budget times this (a quick run on a loaded 2-core VM needs more)")
    parser.add_argument("--only", nargs="+", default=None, help="these steps alone (names as in the summary)")
    parser.add_argument("--test-paths", nargs="+", default=["tests"], help="what `pytest -m cuda` collects")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help=f"default: {RESULTS_DIR.relative_to(REPO)} on a GPU, a temporary directory with --quick")
    parser.add_argument("--doc", type=Path, default=None,
                        help=f"the page the tables go in (default: {DOC.relative_to(REPO)} on a GPU; none with "
                             "--quick)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.quick and importlib.util.find_spec("torch") is None:
        print("gpu-check: this interpreter has no torch; name one whose torch sees the GPU (GPU_PYTHON=...)")
        return 2
    card = device_name(args.quick)
    if not args.quick and card == "no CUDA device":
        print("gpu-check: torch sees no CUDA device here; `--quick` exercises the script on the CPU instead")
        return 2
    results_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="tandem-gpu-check-")) if args.quick else RESULTS_DIR)
    doc_path = args.doc or (None if args.quick else DOC)
    log_dir = results_dir / "gpu_check_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    chosen = [step for step in steps(tuple(args.test_paths)) if args.only is None or step.name in args.only]
    outcomes, start = [], time.perf_counter()
    for step in chosen:
        scaled = dataclasses.replace(step, budget_s=step.budget_s * args.budget_scale)
        outcome = run_step(scaled, args.quick, results_dir, args.deadline_s - (time.perf_counter() - start), log_dir)
        for name in outcome.tables:
            stamp_table(results_dir, name, card, outcome.command)
        outcomes.append(outcome)
        print(f"gpu-check: {outcome.name} {outcome.status} in {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
    total_s = time.perf_counter() - start
    summary = summary_markdown(outcomes, card, total_s, args.deadline_s, missing_modules(OPTIONAL_MODULES))
    (results_dir / "gpu_check.md").write_text(summary)
    tables = [name for outcome in outcomes for name in outcome.tables]
    if doc_path is not None:
        updated = update_doc(doc_path, results_dir, [*tables, "gpu_check"])
        print(f"gpu-check: {doc_path}: refreshed {', '.join(updated)}", file=sys.stderr)
    print_summary(outcomes, summary, results_dir)
    return 0 if all(outcome.status in ("passed", "skipped") for outcome in outcomes) else 1


def print_summary(outcomes: list[Outcome], summary: str, results_dir: Path) -> None:
    for outcome in outcomes:
        if outcome.status in ("failed", "timed out"):
            print(f"\n---- {outcome.name} {outcome.status}; the end of its output "
                  f"({results_dir / 'gpu_check_logs'}):\n{outcome.detail}")
    print(f"\n{summary}")
    print(f"tables and logs: {results_dir}")


if __name__ == "__main__":
    sys.exit(main())
