"""The thread split Algorithm 3 plans (scheduler/planning/threads.py) against every split of a grid,
on the host-only testbed with Neo's CPU attention, weight streaming and MLP slicing all on.

The embedded model (real weights) with every layer's MLP sliced 0.25/0.25/0.5 (CC/CG/GG), a
weight budget that streams about half the layers whole from host memory (from disk too with
--offload-dir and a small --weights-cpu-gib), and a GPU KV pool holding half the batch, so the
other half decodes from the host pool on the CPU. One measurement: a fresh engine at the split
generates OUTPUT_TOKENS for each of NUM_PROMPTS prompts of PROMPT_TOKENS at once; output
tokens/s over the generation (engine start and the first, warm-up request not counted).

Splits: every gpu_threads g x CPU-side threads c x copy threads k (c, k <= the cores g leaves)
x disk reader threads (1..the cores g leaves, only with disk-tier layers), or the lists given;
the planned split (this machine's thread profile, the iteration the planner assumes set to this
workload) and today's default split (half the cores to the GPU) are measured whether in the grid
or not. Configurations interleave per repetition (in order, then reversed); medians. Each split
also gets the planner's predicted iteration time, to compare its ranking with the measured one.

No flag sets the copy engine's threads yet, so the grid sets them where the layer store makes
its copy engine (engine/offload/layer_store.py create_transfer).

    nice -n 10 .venv/bin/python -m benchmarks.offload.thread_split [--reps 3] [--quick] [--offload-dir DIR]
        [--gpu-threads 1 2] [--cpu-threads ...] [--copy-threads ...] [--io-threads ...]

Writes benchmarks/results/thread_split.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)

from benchmarks.report import RESULTS_DIR, run_interleaved, write_results
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.planning.stage import model_max_len
from engine.offload import layer_store
from engine.device.cores import host_cores
from engine.planning.threads import (
    iteration_profiles,
    iteration_volumes,
    plan_thread_split,
    thread_profiles,
)
from engine.planning.weights import plan_model, weight_format
from engine.profiling import compute_dtype
from engine.profiling.cache import host_cpu_model
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.planning import ModelPlan, layer_image_bytes
from scheduler.planning.memory import resident_global_bytes
from scheduler.planning.tiers import Tier
from scheduler.sampling_params import SamplingParams
from scheduler.iteration_plan import PlanMode
from scheduler.planning.threads import TESTBED, ThreadPlan, ThreadSplit, predict_seconds

RESULTS = RESULTS_DIR / "thread_split.json"
NUM_PROMPTS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 64, 64
QUICK_NUM_PROMPTS, QUICK_OUTPUT_TOKENS = 8, 16
BLOCK_SIZE = 16
MLP_SLICING = "0.25,0.25"
STREAMED_LAYER_SHARE = 0.5  # of the decoder layers, what the weight budget leaves to stream whole


# ---- the engine's flags -----------------------------------------------------------------------
def base_flags(args) -> dict:
    """Everything but the split: pools that put half of the batch in the host pool, the iteration
    the planner assumes set to this workload."""
    max_model_len = PROMPT_TOKENS + args.output_tokens
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    flags = dict(model=args.model, dtype=args.dtype, quantization="none", device="testbed", cpu_attention="on",
                 mlp_slicing=MLP_SLICING,
                 weights_gpu_gib=args.weights_gpu_gib, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                 max_num_seqs=args.num_prompts, num_blocks=blocks_per_seq * args.num_prompts // 2,
                 num_cpu_blocks=blocks_per_seq * args.num_prompts,
                 expected_context_len=PROMPT_TOKENS + args.output_tokens // 2, profile_grid=args.profile_grid)
    if args.cost_tables:
        flags["cost_tables"] = args.cost_tables
    if args.offload_dir:
        flags.update(offload_dir=str(args.offload_dir), weights_cpu_gib=args.weights_cpu_gib)
    return flags


def split_flags(split: ThreadSplit) -> dict:
    flags = dict(gpu_threads=split.gpu_threads, cpu_attention_threads=split.cpu_threads)
    if split.io_threads:
        flags["weight_io_threads"] = split.io_threads
    return flags


def default_budget_gib(model: str, dtype_name: str) -> float:
    """Embeddings, head and norms, and the layers STREAMED_LAYER_SHARE leaves resident."""
    model_config = create_loader(model).config
    dtype, _ = compute_dtype(dtype_name, "cpu")
    fmt = weight_format(EngineConfig.from_flat(model=model, quantization="none"), dtype)
    num_resident = round((1 - STREAMED_LAYER_SHARE) * model_config.num_layers)
    return (resident_global_bytes(model_config.shape, dtype.itemsize)
            + num_resident * layer_image_bytes(model_config.shape, fmt)) / 2**30


@contextlib.contextmanager
def copy_engine_threads(num_threads: int):
    """Layer stores made meanwhile copy with `num_threads` threads (no flag sets the count yet)."""
    original = layer_store.create_transfer

    def create_transfer(plan, device, cores, num_io_threads):
        return original(plan, device, dataclasses.replace(cores, copy_threads=num_threads), num_io_threads)
    layer_store.create_transfer = create_transfer
    try:
        yield
    finally:
        layer_store.create_transfer = original


# ---- the splits -------------------------------------------------------------------------------
def grid(args, num_cores: int, reads_disk: bool) -> list[ThreadSplit]:
    splits = []
    for gpu_threads in args.gpu_threads or range(1, num_cores):
        rest = num_cores - gpu_threads
        if rest < 1:
            continue
        io_counts = (args.io_threads or range(1, rest + 1)) if reads_disk else [0]
        for cpu_threads, copy_threads, io_threads in itertools.product(
                args.cpu_threads or range(1, rest + 1), args.copy_threads or range(1, rest + 1), io_counts):
            splits.append(ThreadSplit(gpu_threads, cpu_threads, copy_threads, io_threads))
    return splits


def planned(flags: dict) -> tuple[ThreadPlan, Callable[[ThreadSplit], float], ModelPlan]:
    """(the thread plan, a split's predicted iteration seconds, the model plan) from this
    machine's profiles, as the engine plans once it is wired to."""
    config = EngineConfig.from_flat(**flags)
    model_config = create_loader(config.model, config.load_format).config
    dtype, _ = compute_dtype(config.dtype, config.torch_device)
    max_len = model_max_len(config, model_config)
    model_plan, _ = plan_model(config, model_config, dtype, max_len)
    profiles = thread_profiles(config, model_config, dtype)
    work = iteration_profiles(profiles, iteration_volumes(config, model_config, dtype, model_plan, max_len), TESTBED)
    plan = plan_thread_split(config, model_config, dtype, model_plan, max_len, profiles=profiles)
    num_cores = len(host_cores())
    return plan, lambda split: predict_seconds(split, num_cores, TESTBED, work), model_plan


# ---- one measurement --------------------------------------------------------------------------
def measure(args, flags: dict, split: ThreadSplit) -> dict:
    with copy_engine_threads(split.copy_threads):
        engine = LLMEngine(EngineConfig.from_flat(**flags, **split_flags(split)))
    try:
        vocab = engine.model_config.vocab_size
        run(engine, [[(7 + 31 * j) % vocab for j in range(PROMPT_TOKENS)]], 2)  # first-forward costs
        prompts = [[(13 * i + 7 * j + 1) % vocab for j in range(PROMPT_TOKENS)] for i in range(args.num_prompts)]
        seconds, num_tokens, pipelined_share = run(engine, prompts, args.output_tokens)
        return {"tokens_per_s": num_tokens / seconds, "seconds": seconds, "pipelined_share": pipelined_share}
    finally:
        engine.close()


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, float]:
    """Seconds to generate `max_tokens` for every prompt at once, the tokens generated, and the
    share of iterations Neo ran as two sub-batches (the CPU attending beside the GPU)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    num_tokens, modes = 0, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_tokens += sum(len(c.delta_token_ids) for c in output.outputs)
        modes.append(engine.stats.mode)
    return time.perf_counter() - start, num_tokens, modes.count(PlanMode.PIPELINED) / len(modes)


# ---- the report -------------------------------------------------------------------------------
def label(split: ThreadSplit) -> str:
    return f"g{split.gpu_threads} c{split.cpu_threads} k{split.copy_threads} io{split.io_threads}"


def rows_of(samples: dict[str, list[dict]], splits: dict[str, ThreadSplit], predicted_s, marks: dict) -> list[dict]:
    rows = [{"split": name, **splits[name].to_dict(), "predicted_ms": predicted_s(splits[name]) * 1e3,
             "tokens_per_s": statistics.median(s["tokens_per_s"] for s in runs),
             "pipelined_share": statistics.median(s["pipelined_share"] for s in runs),
             "samples": [s["tokens_per_s"] for s in runs], "marks": marks.get(name, [])}
            for name, runs in samples.items()]
    return sorted(rows, key=lambda row: -row["tokens_per_s"])


def to_markdown(result: dict) -> str:
    rows, summary = result["rows"], result["summary"]
    lines = [f"{result['cpu']}, {result['num_cores']} cores, host-only testbed: {result['model']} in {result['dtype']}, "
             f"MLPs sliced {MLP_SLICING} (CC,CG), {result['num_streamed_layers']} of {result['num_layers']} layers "
             f"streamed whole, half of {result['num_prompts']} sequences decoding on the CPU; "
             f"{result['num_prompts']} x ({PROMPT_TOKENS} prompt + {result['output_tokens']} output) tokens at once. "
             f"Output tokens/s, medians of {result['reps']} interleaved repetitions; g: cores playing the GPU, "
             f"c: CPU-side threads, k: copy engine threads, io: disk reader threads.", "",
             f"Planned ({summary['planned']}): {summary['planned_tokens_per_s']:.1f} tok/s, "
             f"{summary['planned_vs_best']:.2f}x the best split's ({summary['best']}) and "
             f"{summary['planned_vs_default']:.2f}x today's default ({summary['default']}).", "",
             "| split | predicted iteration (ms) | output tok/s | two-batch iterations | |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['split']} | {row['predicted_ms']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['pipelined_share']:.0%} | {', '.join(row['marks'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = base_flags(args)
    plan, predicted_s, model_plan = planned(flags)
    print(f"planned: {plan.describe()}", file=sys.stderr, flush=True)
    reads_disk = bool(model_plan.num_layers_in(Tier.DISK))
    # without disk-tier layers no reader runs, whatever its count: one configuration, not several
    planned_split, default_split = ((s if reads_disk else dataclasses.replace(s, io_threads=0))
                                    for s in (plan.split, plan.default.split))
    marks = {label(planned_split): ["planned"]}
    marks.setdefault(label(default_split), []).append("default")
    num_cores = len(host_cores())
    splits = {label(s): s for s in [planned_split, default_split, *grid(args, num_cores, reads_disk)]}
    print(f"{len(splits)} splits x {args.reps} repetitions", file=sys.stderr, flush=True)
    samples = run_interleaved(splits, args.reps, lambda split: measure(args, flags, split))
    rows = rows_of(samples, splits, predicted_s, marks)
    by_name = {row["split"]: row for row in rows}
    planned_row, default_row = by_name[label(planned_split)], by_name[label(default_split)]
    result = {"cpu": host_cpu_model(), "num_cores": num_cores, "model": args.model, "dtype": args.dtype,
              "num_layers": len(model_plan.layers), "num_streamed_layers": len(model_plan.streamed_layers),
              "num_prompts": args.num_prompts, "output_tokens": args.output_tokens, "reps": args.reps,
              "flags": flags, "plan": plan.to_dict(), "rows": rows,
              "summary": {"planned": planned_row["split"], "default": default_row["split"], "best": rows[0]["split"],
                          "planned_tokens_per_s": planned_row["tokens_per_s"],
                          "planned_vs_best": planned_row["tokens_per_s"] / rows[0]["tokens_per_s"],
                          "planned_vs_default": planned_row["tokens_per_s"] / default_row["tokens_per_s"]}}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--weights-gpu-gib", type=float, default=None,
                        help=f"default: room for the embeddings, head, norms and "
                             f"{round((1 - STREAMED_LAYER_SHARE) * 100)}%% of the layers (the rest stream)")
    parser.add_argument("--offload-dir", type=Path, default=None, help="with --weights-cpu-gib: some layers on disk")
    parser.add_argument("--weights-cpu-gib", type=float, default=0.05)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    for task in ("gpu", "cpu", "copy", "io"):
        parser.add_argument(f"--{task}-threads", type=int, nargs="+", default=None,
                            help="the grid's counts (default: all)")
    parser.add_argument("--profile-grid", default="quick", choices=["quick", "default"],
                        help="the Neo cost tables' grid, profiled once per split and cached")
    parser.add_argument("--cost-tables", default=None, help="one cost-table file for every split instead")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_NUM_PROMPTS} prompts x {QUICK_OUTPUT_TOKENS} tokens, 2 repetitions")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_tokens, args.reps = QUICK_NUM_PROMPTS, QUICK_OUTPUT_TOKENS, 2
    if args.weights_gpu_gib is None:
        args.weights_gpu_gib = default_budget_gib(args.model, args.dtype)
    return args


if __name__ == "__main__":
    sys.exit(main())
