"""Tensor parallelism on this host: the embedded model's decode at one rank and at two (Ray actors,
gloo, each rank one core), and what a step costs beyond rank 0's forward (the plan to the ranks
through Ray's store, the tokens back).

On a CPU-only host this measures the machinery, not a gain: one rank already reads the weights
with both cores, so two ranks split the same bytes over the same cores and add one all-reduce per
attention and per MLP (gloo, over loopback TCP) and the Ray round trip per step. Configurations run
interleaved; medians of REPS."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import ray

from benchmarks.report import RESULTS_DIR, median_rows, run_interleaved, write_results
from engine import LLM, SamplingParams

RESULTS = RESULTS_DIR / "tensor_parallel.json"
PROMPT = "Write a long story about a lighthouse keeper and the sea."
REPS = 3
OUTPUT_TOKENS = 48


def measure(llm: LLM, num_streams: int) -> dict:
    """Decode tokens/s of `num_streams` greedy streams, and each step's time beyond rank 0's forward."""
    runner = llm.engine.runner
    overheads = []
    execute = runner.execute

    def timed(plan):
        start = time.perf_counter()
        output = execute(plan)
        overheads.append(time.perf_counter() - start - output.forward_time)
        return output

    runner.execute = timed
    params = [SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, seed=i)
              for i in range(num_streams)]
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * num_streams, params)
    elapsed = time.perf_counter() - start
    runner.execute = execute
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens_per_s": tokens / elapsed, "step_overhead_ms": 1e3 * statistics.median(overheads)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    llms = {tp: LLM(dtype="float32", cpu_attention="off", tensor_parallel_size=tp) for tp in (1, 2)}
    configs = {f"tp{tp} x{n}": (llms[tp], n) for tp in llms for n in args.streams}
    samples = run_interleaved(configs, args.reps, lambda config: measure(*config))
    rows = median_rows(samples, ("tokens_per_s", "step_overhead_ms"))
    for llm in llms.values():
        llm.close()
    ray.shutdown()
    write_results(RESULTS, {"reps": args.reps, "rows": rows}, markdown(rows, args.streams, args.reps))
    print(markdown(rows, args.streams, args.reps))
    return 0


def markdown(rows: dict[str, dict], streams: list[int], reps: int) -> str:
    lines = ["| streams | tp 1 tokens/s | tp 2 tokens/s | tp 2 / tp 1 | step beyond rank 0's forward, tp 1 | tp 2 |",
             "|---|---|---|---|---|---|"]
    for n in streams:
        one, two = rows[f"tp1 x{n}"], rows[f"tp2 x{n}"]
        lines.append(f"| {n} | {one['tokens_per_s']:.1f} | {two['tokens_per_s']:.1f} | "
                     f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}x | {one['step_overhead_ms']:.2f} ms | "
                     f"{two['step_overhead_ms']:.2f} ms |")
    lines.append(f"\nEmbedded SmolLM2-135M (INT4 as the GGUF stores it), device cpu, {OUTPUT_TOKENS} greedy tokens "
                 f"per stream, medians of {reps} interleaved runs.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
