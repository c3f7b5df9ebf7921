"""Two revisions of tandem side by side: the same offline decode workload on the embedded model,
resident, with sliced MLPs and with layers streamed from host memory, each revision checked out in
its own git worktree and run in its own process, repetitions interleaved (A B, B A, ...).

For a change that should cost nothing (a redesign), the ratio column is the check: medians within
the run's noise of 1.00x. Run as `python -m benchmarks.serving.revisions --base e66490e` (the head
is HEAD); the table lands in docs/benchmarks.md through update_benchmarks_doc.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.report import REPO, RESULTS_DIR, run_interleaved, write_results

# Each mode as LLM(...) keywords every revision since the fit takes (the embedded GGUF, device cpu).
MODES = {
    "resident (int4)": dict(quantization="int4"),
    "sliced MLPs 0.25,0.5": dict(quantization="none", dtype="float32", mlp_slicing="0.25,0.5"),
    "streamed from host": dict(quantization="none", dtype="float32", weights_gpu_gib=0.25),
}
# The workload one run times: its prompts prefilled, then this many tokens decoded by each.
WORKER = """
import json, sys, time
from engine import LLM, SamplingParams
kwargs, num_prompts, num_tokens = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
prompts = [[1, 504 + i, 3287, 314, 260, 1142, 30] for i in range(num_prompts)]
with LLM(max_num_seqs=num_prompts, max_model_len=512, **kwargs) as llm:
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
print(json.dumps({"tokens_per_s": num_prompts * num_tokens / elapsed, "tokens": tokens}))
"""


def checkout(revision: str, into: Path) -> Path:
    """`revision` as a detached worktree under `into`, with this tree's built C++ kernels."""
    path = into / revision.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), revision],
                   check=True, capture_output=True)
    for built in (REPO / "kernels" / "cpu").glob("*.so"):
        (path / "kernels" / "cpu" / built.name).write_bytes(built.read_bytes())
    return path


def measure(tree: Path, mode: dict, num_prompts: int, num_tokens: int) -> dict:
    result = subprocess.run([sys.executable, "-c", WORKER, json.dumps(mode), str(num_prompts), str(num_tokens)],
                            cwd=tree, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"{tree.name}: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def markdown(base: str, head: str, rows: list[dict], reps: int, args: argparse.Namespace) -> str:
    lines = [f"Revisions {base} (base) and {head} (head), {args.num_prompts} prompts x {args.num_tokens} "
             f"decoded tokens, medians of {reps} interleaved runs each, device cpu, embedded model.", "",
             "| mode | base tokens/s (min-max) | head tokens/s (min-max) | head / base | same greedy tokens |",
             "| --- | ---: | ---: | ---: | --- |"]
    for row in rows:
        base, head = row["base_range"], row["head_range"]
        lines.append(f"| {row['mode']} | {row['base']:.1f} ({base[0]:.0f}-{base[1]:.0f}) | {row['head']:.1f} "
                     f"({head[0]:.0f}-{head[1]:.0f}) | {row['ratio']:.2f}x | {'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against (a commit or branch)")
    parser.add_argument("--head", default="HEAD", help="the revision measured against it")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--num-tokens", type=int, default=48)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "revisions.json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-revisions-") as scratch:
        trees = {"base": checkout(args.base, Path(scratch)), "head": checkout(args.head, Path(scratch))}
        try:
            for name, mode in MODES.items():
                samples = run_interleaved(trees, args.reps,
                                          lambda tree: measure(tree, mode, args.num_prompts, args.num_tokens))
                speed = {side: statistics.median(s["tokens_per_s"] for s in runs) for side, runs in samples.items()}
                spread = {f"{side}_range": (min(s["tokens_per_s"] for s in runs), max(s["tokens_per_s"] for s in runs))
                          for side, runs in samples.items()}
                same = all(s["tokens"] == samples["base"][0]["tokens"] for runs in samples.values() for s in runs)
                rows.append({"mode": name, **speed, **spread, "ratio": speed["head"] / speed["base"],
                             "same_tokens": same})
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    base, head = (_short(args.base), _short(args.head))
    write_results(args.output, {"base": base, "head": head, "reps": args.reps, "rows": rows},
                  markdown(base, head, rows, args.reps, args))
    print(args.output.with_suffix(".md").read_text())
    return 0


def _short(revision: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", revision], capture_output=True,
                          text=True, check=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
