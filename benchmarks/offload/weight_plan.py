"""`tandem plan`'s predictions against what the engine then does: memory and decode tokens/s on
three placements of one model (all resident; some layers resident and the rest streamed from host
memory; every layer streamed from disk), on the host-only testbed.

Each configuration runs in a fresh process: the plan is made as `tandem plan` makes it (this
machine's measured rates and compute), then the engine is built with the same flags and decodes
the batch the plan's estimate is for (its batch of sequences at its context length: prompts a few
tokens short of it, then decode steps). Measured:
  memory    the process's peak resident memory while serving (VmHWM, reset once the weights are
            loaded) less its resident memory before the engine was built: on the testbed the
            GPU's memory is host memory too, so this is the plan's GPU total
            (weights, buffers, KV pool, activations) plus its host total (streamed layers, staging)
  tokens/s  the batch over the median decode step
Configurations alternate order each repetition; medians.

    nice -n 10 .venv/bin/python -m benchmarks.offload.weight_plan [--reps 2] [--offload-dir DIR]

Writes benchmarks/results/weight_plan.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import REPO, RESULTS_DIR, median_rows, run_interleaved, write_results

RESULTS = RESULTS_DIR / "weight_plan.json"
DECODE_STEPS = 12
PROMPT_SHORTFALL = DECODE_STEPS // 2  # prompts this much short of the context: contexts average it


def configurations(offload_dir: Path) -> dict[str, dict]:
    return {
        "all resident": dict(weight_placement="gpu"),
        "resident + host": dict(weights_gpu_gib=1.2),
        "all disk": dict(weight_placement="disk", weights_gpu_gib=1.0, offload_dir=str(offload_dir)),
    }


def common(args) -> dict:
    return dict(model=args.model, load_format="dummy", dtype=args.dtype, device="testbed", cpu_attention="off",
                max_model_len=args.context_len + DECODE_STEPS, max_num_seqs=args.max_num_seqs,
                kv_cache_memory_gib=args.kv_cache_gib, expected_context_len=args.context_len)


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _measure_first(config) -> None:
    """The planner's measurements (random-weight layers, probe buffers) before the baseline is
    taken: they are cached for the process, so the engine's start reuses them, and what they
    allocated and freed is not counted as the engine's."""
    import gc

    from engine.planning.weights import measure
    from engine.profiling import compute_dtype
    from engine.weights import create_loader

    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    measure(config, create_loader(config.model, config.load_format, seed=config.seed).config, dtype)
    gc.collect()


def measure_one(flags: dict) -> dict:
    """In this process: plan, build, decode; -> predictions and measurements."""
    import kernels  # noqa: F401  (before torch)
    import torch  # noqa: F401

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    config = EngineConfig.from_flat(**flags)
    _measure_first(config)
    before = _rss_bytes("VmRSS")
    engine = LLMEngine(config)
    try:
        placement = engine.plan.layers.placement
        estimate = placement.estimate
        _reset_peak_rss()
        vocab, batch = engine.model_config.vocab_size, estimate.batch
        params = SamplingParams(max_tokens=DECODE_STEPS, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request([(13 * i + 7 * j) % vocab for j in range(estimate.context_len - PROMPT_SHORTFALL)], params)
        steps = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            if engine.stats.num_prompt_tokens == 0 and engine.stats.num_generation_tokens == batch:
                steps.append(time.perf_counter() - start)
        peak = _rss_bytes("VmHWM")
    finally:
        engine.close()
    memory = placement.memory
    return {"tiers": "".join(t[0].upper() for t in placement.tiers), "pipeline": placement.pipeline,
            "batch": batch, "context_len": estimate.context_len,
            "predicted_tokens_per_s": estimate.tokens_per_s, "measured_tokens_per_s": batch / statistics.median(steps),
            "predicted_bytes": memory.gpu_bytes + memory.host_bytes, "measured_bytes": peak - before,
            "predicted_gpu_bytes": memory.gpu_bytes, "predicted_host_bytes": memory.host_bytes,
            "num_decode_steps": len(steps)}


# glibc keeps freed blocks below a threshold that grows with the largest block freed (up to 32
# MiB), so RSS would hold what loading layers freed; a fixed 1 MiB threshold hands big blocks back
# and RSS is what the engine holds.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def run_in_subprocess(flags: dict) -> dict:
    import os

    # this module again, as `python -m` runs it, from the folder that holds the benchmarks package
    out = subprocess.run([sys.executable, "-m", __spec__.name, "--one", json.dumps(flags)], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ, **MALLOC_ENV})
    if out.returncode:
        raise RuntimeError(f"configuration {flags} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, host-only testbed, {result['model']} random weights in {result['dtype']}, decode of "
             f"the plan's batch at {result['context_len']}-token contexts; memory = peak RSS while serving less RSS "
             f"before the engine (the testbed's GPU memory is host memory); medians of {result['reps']} "
             f"interleaved runs, each in a fresh process.", "",
             "| configuration | layers (A/H/D) | pipeline | batch | predicted GiB | measured GiB | memory error | "
             "predicted tokens/s | measured tokens/s | tokens/s error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['tiers']} | {row['pipeline'] or '-'} | {row['batch']} | "
                     f"{row['predicted_bytes'] / 2**30:.2f} | {row['measured_bytes'] / 2**30:.2f} | "
                     f"{row['memory_error']:+.1%} | {row['predicted_tokens_per_s']:.1f} | "
                     f"{row['measured_tokens_per_s']:.1f} | {row['tokens_per_s_error']:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--offload-dir", type=Path, default=Path.home() / ".cache" / "tandem" / "bench-offload")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(json.loads(args.one))))
        return 0
    from engine.profiling.cache import host_cpu_model

    configs = configurations(args.offload_dir)
    samples = run_interleaved(configs, args.reps, lambda config: run_in_subprocess({**common(args), **config}))
    rows = median_rows(samples, ("measured_tokens_per_s", "measured_bytes", "predicted_tokens_per_s", "predicted_bytes"))
    for row in rows.values():
        row["memory_error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
        row["tokens_per_s_error"] = row["predicted_tokens_per_s"] / row["measured_tokens_per_s"] - 1
    result = {"cpu": host_cpu_model(), "model": args.model, "dtype": args.dtype, "context_len": args.context_len,
              "reps": args.reps, "rows": rows, "samples": samples}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
