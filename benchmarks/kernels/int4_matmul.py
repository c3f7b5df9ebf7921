"""INT4 weight matmul on the CPU from decode to prefill: the int8-activation kernel beside the
int16 one, dequantize + dense GEMM, and the dense bf16 GEMM, side by side in the same rounds.

For SmolLM2-135M's matmul shapes (the embedded model: QKV, gate|up, down) and Llama-3.1-8B's, and
1 to 2,048 rows of bf16 x (the compute dtype here), each round samples the machine's read bandwidth
(torch.sum over 2 GiB, benchmarks/kernels/cpu_attention.py's ReadBandwidth) and then times,
interleaved, all on torch's thread count: `int4_linear` with int8 activations (the engine's path
above 64 rows), with int16 activations (up to 64), the weight dequantized to bf16 into a scratch
buffer followed by `F.linear` (the engine's path above 64 rows before the int8 kernel), and the
dense bf16 `F.linear`. Calls rotate
over enough copies of each weight that the bytes between two visits to one copy exceed the
last-level cache, so decode-sized calls read the weight from DRAM. The bandwidth bound is the
packed weight's bytes over the round's read bandwidth: the time a call cannot beat. Rows are
medians over the rounds; the ratios are each path's time over the int8 kernel's (above 1: int8 is
faster).

    .venv/bin/python -m benchmarks.kernels.int4_matmul [--quick]
Writes benchmarks/results/int4_matmul.json and .md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import torch
import torch.nn.functional as F

from benchmarks.kernels.cpu_attention import ReadBandwidth
from benchmarks.report import RESULTS_DIR, write_results
from engine.profiling.cache import host_cpu_model
from engine.profiling.profiler import median_seconds
from kernels.cpu import int4

# (out, in): SmolLM2-135M's QKV, gate|up, down; Llama-3.1-8B's QKV-ish/O, gate|up, down
SHAPES = [(960, 576), (3072, 576), (576, 1536), (4096, 4096), (14336, 4096), (4096, 14336)]
ROWS = [1, 4, 16, 64, 128, 256, 512, 1024, 2048]
GROUP_SIZE = 32
ROTATION_BYTES = 256 << 20  # packed bytes touched between two calls on one weight copy
ROUNDS = 3
MAX_REPS = 5
SECONDS_PER_SAMPLE = 0.3  # fewer repetitions for slow calls, at least one
PATHS = ("int8", "int16", "dequant_bf16", "bf16")


class Candidates:
    """One shape's weight as the packed tiles and as dense bf16, several copies each for the rotation."""

    def __init__(self, n: int, k: int, num_copies: int, num_threads: int):
        gen = torch.Generator().manual_seed(n + k)
        dense = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(num_copies)]
        self.int4 = [int4.TiledInt4.from_packed(*int4.quantize_rtn(w, GROUP_SIZE), GROUP_SIZE) for w in dense]
        self.bf16 = [w.bfloat16() for w in dense]
        self.scratch = torch.empty(n, k, dtype=torch.bfloat16)  # shared, as the engine's DequantScratch
        self.packed_bytes = self.int4[0].nbytes
        self.num_threads = num_threads
        self.turn = 0

    def next(self) -> int:
        self.turn = (self.turn + 1) % len(self.bf16)
        return self.turn

    def runners(self, x: torch.Tensor) -> dict:
        threads = self.num_threads
        return {
            "int8": lambda: int4.int4_linear(x, self.int4[self.next()], num_threads=threads),
            "int16": lambda: int4.int4_linear(x, self.int4[self.next()], num_threads=threads, activation_bits=16),
            "dequant_bf16": lambda: F.linear(x, int4.dequantize_into(self.int4[self.next()], self.scratch,
                                                                     num_threads=threads)),
            "bf16": lambda: F.linear(x, self.bf16[self.next()]),
        }


def timed(run) -> float:
    """Median seconds of a call, with as many repetitions as SECONDS_PER_SAMPLE allows."""
    start = time.perf_counter()
    run()  # warm-up, and the estimate
    reps = max(1, min(MAX_REPS, int(SECONDS_PER_SAMPLE / max(time.perf_counter() - start, 1e-6))))
    return median_seconds(run, warmup=0, repetitions=reps)


def measure(n: int, k: int, rows: list[int], bandwidth: ReadBandwidth, num_threads: int) -> list[dict]:
    packed_bytes = n * k // 2 + 2 * n * (k // GROUP_SIZE) * 4
    candidates = Candidates(n, k, max(2, -(-ROTATION_BYTES // packed_bytes)), num_threads)
    results = []
    for num_rows in rows:
        runners = candidates.runners(torch.randn(num_rows, k).bfloat16())
        samples: dict[str, list[float]] = {name: [] for name in ("read_bw", *runners)}
        for _ in range(ROUNDS):
            samples["read_bw"].append(bandwidth.sample())
            for name, run in runners.items():  # interleaved: drift hits every path alike
                samples[name].append(timed(run))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        bound = candidates.packed_bytes / medians["read_bw"]
        results.append({"n": n, "k": k, "rows": num_rows, "read_bw_gbs": medians["read_bw"] / 1e9,
                        "bandwidth_bound_ms": bound * 1e3,
                        **{f"{name}_ms": medians[name] * 1e3 for name in PATHS}})
        print(results[-1], file=sys.stderr, flush=True)
    return results


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, {result['threads']} threads, group size {GROUP_SIZE}, bf16 x, medians of {ROUNDS} "
             f"interleaved rounds; bound: the packed weight read once at the round's read bandwidth "
             f"(torch.sum over 2 GiB); ratios: a path's time over the int8 kernel's",
             "", "| out x in | rows | int8 ms | int8 / bound | int16 / int8 | dequant + bf16 GEMM / int8 | "
                 "dense bf16 / int8 |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        int8 = row["int8_ms"]
        lines.append(f"| {row['n']}x{row['k']} | {row['rows']} | {int8:.2f} | {int8 / row['bandwidth_bound_ms']:.2f} | "
                     f"{row['int16_ms'] / int8:.2f}x | {row['dequant_bf16_ms'] / int8:.2f}x | "
                     f"{row['bf16_ms'] / int8:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2's gate|up, rows 1, 128 and 2048")
    parser.add_argument("--shapes", nargs="+", help="out x in, e.g. 3072x576 (default: all)")
    args = parser.parse_args()
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    shapes, rows = ([(3072, 576)], [1, 128, 2048]) if args.quick else (shapes, ROWS)
    threads = torch.get_num_threads()  # every path on the same cores
    bandwidth = ReadBandwidth(threads)
    results = [row for n, k in shapes for row in measure(n, k, rows, bandwidth, threads)]
    result = {"cpu": host_cpu_model(), "threads": threads, "cores": len(os.sched_getaffinity(0)), "rows": results}
    write_results(RESULTS_DIR / "int4_matmul.json", result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
