"""Neo on a real CUDA GPU: offloading vs GPU-only, offline, side by side in one process.

A preset model with seeded random weights (`--load-format dummy`: no weights to download) runs
the same all-at-once workload through two engines built once each: GPU-only (`cpu_attention=off`)
and tandem (host KV pool, Neo's scheduler on cost tables profiled on this machine). The
GPU pool is capped (`--num-gpu-blocks`) to emulate a GPU short of memory, then lifted
(`--uncapped-gib`): with room for everything there is nothing to gain and nothing may be lost.
Repetitions alternate the order (A B, B A); the table gives medians and the ratios.

    python -m benchmarks.gpu.neo_gpu [--model llama-3.1-8b] [--num-gpu-blocks 196] [--reps 2]
    python -m benchmarks.gpu.neo_gpu --quick --device testbed   (no GPU: a small model and workload, the
        script exercised on the testbed)

Needs a CUDA device; writes benchmarks/results/neo_gpu.json and .md (docs/benchmarks.md's
`<!-- bench:neo_gpu -->` block).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import RESULTS_DIR
from engine import LLM, SamplingParams
from engine.weights import create_loader

RESULTS = RESULTS_DIR / "neo_gpu.json"
SYSTEMS = ("gpu-only", "tandem")


def make_workload(num_requests: int, input_len: int, input_spread: float, output_len: int,
                  output_spread: float, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, uniform within +-spread of each length."""
    rng = random.Random(seed)

    def around(length: int, spread: float) -> int:
        return max(1, round(length * (1 + rng.uniform(-spread, spread))))

    return [([rng.randrange(vocab_size) for _ in range(around(input_len, input_spread))],
             around(output_len, output_spread)) for _ in range(num_requests)]


def run_once(llm: LLM, workload) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    scheduler = llm.engine.scheduler
    counters = ("num_cpu_prefills", "num_swap_out", "num_swap_in")  # the Neo scheduler's; 0 for GPU-only
    before = {name: getattr(scheduler, name, 0) for name in counters}
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    num_tokens = [len(o.outputs[0].token_ids) for o in outputs]
    if num_tokens != [n for _, n in workload]:
        raise RuntimeError("an engine stopped a request short of its max_tokens")
    per_token = [(o.metrics.finished_time - o.metrics.arrival_time) / n for o, n in zip(outputs, num_tokens)]
    return {"seconds": elapsed, "output_tokens_per_s": sum(num_tokens) / elapsed,
            "p50_per_token_latency_ms": 1e3 * statistics.median(per_token),
            **{name: getattr(scheduler, name, 0) - before[name] for name in counters}}


def compare(args, engine_options: dict, workload, label: str) -> dict:
    engines = {name: LLM(cpu_attention="off" if name == "gpu-only" else "on", **engine_options) for name in SYSTEMS}
    try:
        for llm in engines.values():  # warm-up: kernels compiled, allocator primed
            run_once(llm, workload[: max(1, len(workload) // 8)])
        runs = {name: [] for name in SYSTEMS}
        for rep in range(args.reps):
            for name in (SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]):
                runs[name].append(run_once(engines[name], workload))
                print(f"{label} rep {rep} {name}: {runs[name][-1]}", flush=True)
    finally:
        for llm in engines.values():
            llm.close()
    def ratios(key: str) -> list[float]:  # tandem over GPU-only, repetition by repetition
        return [t[key] / g[key] for t, g in zip(runs["tandem"], runs["gpu-only"])]

    throughput, latency = ratios("output_tokens_per_s"), ratios("p50_per_token_latency_ms")
    return {"label": label, "runs": runs, "throughput_ratio": statistics.median(throughput),
            "throughput_ratios": throughput, "p50_latency_ratio": statistics.median(latency),
            "p50_latency_ratios": latency}


def to_markdown(result: dict) -> str:
    setup = result["setup"]
    lines = [f"{setup['device']}, {setup['model']} (random weights, {setup['dtype']}), {setup['num_requests']} "
             f"requests at once, in {setup['input_len']} (+-{setup['input_spread']:.0%}) / out "
             f"{setup['output_len']} (+-{setup['output_spread']:.0%}) tokens, host {setup['host']}, "
             f"{setup['reps']} repetitions (A B, B A)", "",
             "| GPU pool | system | out tok/s (median) | p50 per-token ms (median) | CPU-bound prefills | "
             "swaps out/in | tandem / GPU-only throughput | p50 per-token latency |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in result["cases"]:
        for name in SYSTEMS:
            runs = case["runs"][name]
            ratio = (f"**{case['throughput_ratio']:.2f}x** [{min(case['throughput_ratios']):.2f}-"
                     f"{max(case['throughput_ratios']):.2f}]") if name == "tandem" else ""
            latency = f"{case['p50_latency_ratio']:.2f}x" if name == "tandem" else ""
            last = runs[-1]
            throughput = statistics.median(r["output_tokens_per_s"] for r in runs)
            per_token = statistics.median(r["p50_per_token_latency_ms"] for r in runs)
            lines.append(f"| {case['label']} | {name} | {throughput:.0f} | {per_token:.1f} | {last['num_cpu_prefills']} | "
                         f"{last['num_swap_out']}/{last['num_swap_in']} | {ratio} | {latency} |")
    return "\n".join(lines) + "\n"


# --quick's sizes: a small model and workload, the capped pool alone
QUICK = {"model": "smollm2-135m", "num_gpu_blocks": 12, "cpu_kv_gib": 0.25, "num_requests": 4, "input_len": 32,
         "output_len": 8, "reps": 1, "cases": ["capped"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a preset in configs/models")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-gpu-blocks", type=int, default=196,
                        help="the capped GPU pool, in 16-token blocks (196: four 784-token requests)")
    parser.add_argument("--uncapped-gib", type=float, default=8.0, help="the GPU pool with the cap lifted")
    parser.add_argument("--cpu-kv-gib", type=float, default=16.0)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=240)
    parser.add_argument("--input-spread", type=float, default=0.1)
    parser.add_argument("--output-len", type=int, default=192)
    parser.add_argument("--output-spread", type=float, default=0.6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--cases", nargs="+", choices=["capped", "uncapped"], default=["capped", "uncapped"],
                        help="which GPU pools to run (a short GPU session: capped alone)")
    parser.add_argument("--profile-cache-dir", default=None)
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        print("neo_gpu.py needs a CUDA device (or --device testbed for a dry run)", file=sys.stderr)
        return 2
    common = dict(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
                  max_num_seqs=args.max_num_seqs, cpu_kv_cache_memory_gib=args.cpu_kv_gib,
                  profile_cache_dir=args.profile_cache_dir, show_progress=True)
    vocab_size = create_loader(args.model, "dummy").config.vocab_size
    workload = make_workload(args.num_requests, args.input_len, args.input_spread, args.output_len,
                             args.output_spread, vocab_size, seed=0)
    cases = []
    pools = {"capped": (f"capped: {args.num_gpu_blocks} blocks", {"num_blocks": args.num_gpu_blocks}),
             "uncapped": (f"uncapped: {args.uncapped_gib:g} GiB", {"kv_cache_memory_gib": args.uncapped_gib})}
    for label, pool in (pools[case] for case in args.cases):
        cases.append(compare(args, {**common, **pool}, workload, label))
        if on_cuda:
            torch.cuda.empty_cache()
    setup = {key: getattr(args, key) for key in ("model", "dtype", "num_requests", "input_len", "input_spread",
                                                  "output_len", "output_spread", "reps", "num_gpu_blocks")}
    setup.update(device=torch.cuda.get_device_name() if on_cuda else args.device,
                 host=f"{platform.machine()} {os.cpu_count()} CPUs")
    result = {"setup": setup, "cases": cases}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    markdown = to_markdown(result)
    args.output.with_suffix(".md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
