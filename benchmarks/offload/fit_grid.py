"""LM-Offload's fit on the host-only testbed: the automatic configuration against every fixed one
the fit weighs, measured side by side in one run, over a grid of memory budgets and workloads.

For each (GPU budget, host budget) x workload cell the fit runs as `tandem serve` would
(`--gpu-memory-gib`, `--host-memory-gib`, `--max-num-seqs`, `--expected-context-len`), then
every KV format the model takes (the weight format is fixed on the testbed: INT4 does not run
there) at its most and its fewest resident layers that fit (and the fit's own placement of it),
each an engine of its own, measured on the same requests (random prompts, greedy, no early stop),
interleaved repetition by repetition. Reported per cell: the auto configuration's output tokens/s
against the best and the worst fixed one (targets: >= 0.95x the best, >= 1.5x the worst), and the
predicted decode tokens/s against the measured decode-only iterations' (target: within 20%).

    nice -n 10 .venv/bin/python -m benchmarks.offload.fit_grid [--reps 2] [--quick]

Writes benchmarks/results/fit_grid.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)

from benchmarks.report import RESULTS_DIR, write_results
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.planning.stage import model_max_len
from engine.planning.fit import apply_fit, default_offload_dir, fit_config, fit_request
from engine.profiling import compute_dtype
from engine.profiling.cache import host_cpu_model
from engine.weights import create_loader
from scheduler.planning.fit import Configuration, Fit
from scheduler.planning.fit.search import placements_of, with_predictions
from scheduler.sampling_params import SamplingParams

MODEL = "smollm2-135m"  # on the testbed in float32: 0.50 GiB of weights, 46 KB of KV a token
# (GPU GiB, host GiB): all resident with room, resident with a small GPU pool, some layers
# streamed, most layers streamed
BUDGETS = ((0.8, 1.0), (0.6, 0.5), (0.45, 1.0), (0.35, 0.4))
# name -> (sequences, prompt tokens, output tokens)
WORKLOADS = {"short chat": (16, 64, 48), "long context": (4, 768, 24)}
MAX_MODEL_LEN = 2048


def base_config(gpu_gib: float, host_gib: float, workload: tuple[int, int, int]) -> EngineConfig:
    num_seqs, prompt_len, output_len = workload
    return EngineConfig.from_flat(model=MODEL, device="testbed", dtype="float32", gpu_memory_gib=gpu_gib,
                                  host_memory_gib=host_gib, max_num_seqs=num_seqs, max_model_len=MAX_MODEL_LEN,
                                  expected_context_len=prompt_len + output_len // 2)


def fixed_configurations(fitted: Fit, request_of) -> list[Configuration]:
    """Per option weighed: its most and fewest resident placements that fit, and the fit's own."""
    chosen = []
    for best in fitted.options:
        every = [c for c in with_predictions(*request_of(best)) if not isinstance(c, str)]
        if not every:
            continue
        for c in (max(every, key=lambda c: c.num_resident), min(every, key=lambda c: c.num_resident), best):
            if all(_key(c) != _key(o) for o in chosen):
                chosen.append(c)
    return chosen


def _key(c: Configuration) -> tuple:
    return c.option.quantization, c.option.kv.name, c.tiers, c.pipeline, c.gpu_kv_bytes, c.host_kv_bytes


def label(c: Configuration) -> str:
    resident = f"{c.num_resident}/{len(c.tiers)} resident"
    return f"{c.option.kv.name} KV, {resident}" + (f", {c.pipeline} pipeline" if c.pipeline else "")


def run_engine(config: EngineConfig, workload: tuple[int, int, int], vocab_size: int) -> dict:
    """The workload's requests all at once through a fresh engine: output tokens/s over the run, and
    over its decode-only iterations."""
    num_seqs, prompt_len, output_len = workload
    rng = random.Random(0)
    engine = LLMEngine(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for _ in range(num_seqs):
            engine.add_request([rng.randrange(vocab_size) for _ in range(prompt_len)], params)
        decode_tokens, decode_s, total_tokens = 0, 0.0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            engine.step()
            stats = engine.stats
            total_tokens += stats.num_generation_tokens
            if stats.num_prompt_tokens == 0 and stats.num_generation_tokens:
                decode_tokens += stats.num_generation_tokens
                decode_s += time.perf_counter() - step_start
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    return {"output_tokens_per_s": total_tokens / elapsed,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0}


def run_cell(gpu_gib: float, host_gib: float, name: str, workload: tuple[int, int, int], reps: int) -> dict:
    config = base_config(gpu_gib, host_gib, workload)
    loader = create_loader(MODEL)
    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    auto_config, fitted = fit_config(config, loader, dtype, model_max_len(config, loader.config), predict_always=True)
    offload_dir = default_offload_dir(loader.source)
    request = fit_request(config, loader, dtype, model_max_len(config, loader.config))
    fixed = fixed_configurations(fitted, lambda best: (request, placements_of(request, best.option, None),
                                                       request.measure()))
    engines = {label(c): apply_fit(config, dataclasses.replace(fitted, chosen=c), loader.config, offload_dir)
               for c in fixed}
    auto_label = label(fitted.chosen)
    vocab = loader.config.vocab_size
    runs: dict[str, list[dict]] = {key: [] for key in engines}
    for rep in range(reps):
        for key in (list(engines) if rep % 2 == 0 else list(reversed(engines))):
            runs[key].append(run_engine(engines[key], workload, vocab))
            print(f"{gpu_gib}/{host_gib} {name} {key} rep {rep}: {runs[key][-1]}", file=sys.stderr, flush=True)
    rows = {key: {metric: statistics.median(r[metric] for r in rs) for metric in rs[0]} for key, rs in runs.items()}
    predicted = {label(c): c.prediction.tokens_per_s for c in fixed}
    outputs = [row["output_tokens_per_s"] for row in rows.values()]
    auto = rows[auto_label]
    return {"gpu_gib": gpu_gib, "host_gib": host_gib, "workload": name, "auto": auto_label, "reason": fitted.reason,
            "rows": rows, "predicted": predicted,
            "auto_vs_best": auto["output_tokens_per_s"] / max(outputs),
            "auto_vs_worst": auto["output_tokens_per_s"] / min(outputs),
            "prediction_vs_measured": predicted[auto_label] / auto["decode_tokens_per_s"]
            if auto["decode_tokens_per_s"] else None}


def to_markdown(result: dict) -> str:
    lines = [f"LM-Offload's fit on the testbed ({result['cpu']}, {MODEL} in float32, {result['reps']} interleaved "
             f"repetitions, medians): the auto configuration against every fixed one the fit weighs, per cell.", "",
             "| GPU / host GiB | workload | auto's choice | auto / best fixed | auto / worst fixed | "
             "predicted / measured decode |", "|---|---|---|---|---|---|"]
    for cell in result["cells"]:
        ratio = cell["prediction_vs_measured"]
        lines.append(f"| {cell['gpu_gib']} / {cell['host_gib']} | {cell['workload']} | {cell['auto']} | "
                     f"{cell['auto_vs_best']:.2f} | {cell['auto_vs_worst']:.2f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    lines += ["", "Each cell's configurations (output tokens/s over the run; decode-only iterations; "
              "predicted decode):", ""]
    for cell in result["cells"]:
        rows = "; ".join(f"{key}: {row['output_tokens_per_s']:.1f} / {row['decode_tokens_per_s']:.1f} / "
                         f"{cell['predicted'][key]:.1f}" for key, row in cell["rows"].items())
        lines.append(f"- {cell['gpu_gib']} / {cell['host_gib']} GiB, {cell['workload']}: {rows}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one budget, one repetition: a check that it runs")
    parser.add_argument("--output", default=str(RESULTS_DIR / "fit_grid.json"))
    args = parser.parse_args()
    budgets = BUDGETS[1:2] if args.quick else BUDGETS
    reps = 1 if args.quick else args.reps
    cells = [run_cell(gpu, host, name, workload, reps) for gpu, host in budgets for name, workload in WORKLOADS.items()]
    result = {"cpu": host_cpu_model(), "reps": reps, "cells": cells}
    write_results(Path(args.output), result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
