"""INT4 weight matmul on the CPU: time and effective weight bandwidth against the machine's read
bandwidth, beside the dense paths and torch's own int4 kernel, side by side in the same rounds.

For Llama-3.1-8B's matmul shapes (4096x4096, 14336x4096, 4096x14336) and batches 1, 4, 16, 64,
each round samples the read bandwidth (torch.sum over 2 GiB, benchmarks/kernels/cpu_attention.py's
ReadBandwidth) and then times, interleaved, tandem's INT4 linear (`Int4Weight.apply`: the packed
kernel up to 64 rows (int16 activations), the dequantized weight and a dense GEMM above; with fp32 activations, and
with bf16 ones, whose large batches then run a bf16 GEMM), the dense fp32 and bf16 `F.linear`, and torch's
`_weight_int4pack_mm_for_cpu` (bf16 activations, group 32). Calls rotate over enough copies of
each weight that the bytes between two visits to one copy exceed the last-level cache, so the
weights come from DRAM as in a decode step. Effective bandwidth = packed bytes (int4 codes,
scales and mins) / time; the table gives it as a share of the read bandwidth of its round.
Rows are medians over the rounds.

    .venv/bin/python -m benchmarks.kernels.int4_matmul [--quick]
Writes benchmarks/results/int4_matmul.json and .md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import torch
import torch.nn.functional as F

from benchmarks.kernels.cpu_attention import ReadBandwidth, median_time
from benchmarks.report import RESULTS_DIR, write_results
from engine.profiling.cache import host_cpu_model
from engine.quant import create_linear_method

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out, in): QKV-ish/O, gate|up, down
BATCHES = [1, 4, 16, 64]
GROUP_SIZE = 32
ROTATION_BYTES = 256 << 20  # packed bytes touched between two calls on one weight copy
ROUNDS = 3
REPS = 5


class Candidates:
    """One shape's weights in every format, several copies each for the rotation."""

    def __init__(self, n: int, k: int, num_copies: int):
        gen = torch.Generator().manual_seed(n + k)
        dense = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(num_copies)]
        method = create_linear_method("int4")
        self.int4 = [method.create_weight(w, None, dtype=torch.float32, device=torch.device("cpu")) for w in dense]
        self.fp32 = dense
        self.bf16 = [w.bfloat16() for w in dense]
        levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        self.torch_int4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2) for _ in dense]
        self.torch_scales = torch.randn(k // GROUP_SIZE, n, 2, generator=gen).bfloat16()
        self.packed_bytes = self.int4[0].nbytes
        self.turn = 0

    def next(self) -> int:
        self.turn = (self.turn + 1) % len(self.fp32)
        return self.turn

    def runners(self, x: torch.Tensor) -> dict:
        x_bf16 = x.bfloat16()
        return {
            "int4": lambda: self.int4[self.next()].apply(x),
            "int4_bf16": lambda: self.int4[self.next()].apply(x_bf16),
            "fp32": lambda: F.linear(x, self.fp32[self.next()]),
            "bf16": lambda: F.linear(x_bf16, self.bf16[self.next()]),
            "torch_int4": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x_bf16, self.torch_int4[self.next()], GROUP_SIZE, self.torch_scales),
        }


def measure(n: int, k: int, batches: list[int], bandwidth: ReadBandwidth) -> list[dict]:
    int4_bytes = n * k // 2 + 2 * n * (k // GROUP_SIZE) * 4
    candidates = Candidates(n, k, num_copies=max(2, -(-ROTATION_BYTES // int4_bytes)))
    rows = []
    for batch in batches:
        x = torch.randn(batch, k)
        runners = candidates.runners(x)
        samples: dict[str, list[float]] = {name: [] for name in ("read_bw", *runners)}
        for _ in range(ROUNDS):
            samples["read_bw"].append(bandwidth.sample())
            for name, run in runners.items():  # interleaved: drift hits every path alike
                samples[name].append(median_time(run, reps=REPS))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        effective = candidates.packed_bytes / medians["int4"]
        rows.append({"n": n, "k": k, "batch": batch, "read_bw_gbs": medians["read_bw"] / 1e9,
                     "int4_ms": medians["int4"] * 1e3, "int4_gbs": effective / 1e9,
                     "int4_share_of_read_bw": effective / medians["read_bw"],
                     "int4_bf16_ms": medians["int4_bf16"] * 1e3,
                     "fp32_ms": medians["fp32"] * 1e3, "bf16_ms": medians["bf16"] * 1e3,
                     "torch_int4_ms": medians["torch_int4"] * 1e3})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def to_markdown(result: dict) -> str:
    lines = [f"{result['cpu']}, {result['threads']} threads, group size {GROUP_SIZE}, medians of {ROUNDS} "
             f"rounds of {REPS} calls; read BW: torch.sum over 2 GiB in the same rounds",
             "", "| out x in | batch | int4 ms | int4 GB/s | % of read BW | int4 (bf16 x) ms | fp32 ms | bf16 ms | "
                 "torch int4 ms | best int4 vs best dense |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        best_dense = min(row["fp32_ms"], row["bf16_ms"])
        best_int4 = min(row["int4_ms"], row["int4_bf16_ms"])
        lines.append(f"| {row['n']}x{row['k']} | {row['batch']} | {row['int4_ms']:.2f} | {row['int4_gbs']:.1f} | "
                     f"{100 * row['int4_share_of_read_bw']:.0f}% | {row['int4_bf16_ms']:.2f} | {row['fp32_ms']:.2f} | "
                     f"{row['bf16_ms']:.2f} | {row['torch_int4_ms']:.2f} | {best_dense / best_int4:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, batches 1 and 16")
    args = parser.parse_args()
    shapes, batches = (SHAPES[:1], [1, 16]) if args.quick else (SHAPES, BATCHES)
    threads = torch.get_num_threads()
    bandwidth = ReadBandwidth(threads)
    rows = [row for n, k in shapes for row in measure(n, k, batches, bandwidth)]
    result = {"cpu": host_cpu_model(), "threads": threads, "cores": len(os.sched_getaffinity(0)), "rows": rows}
    write_results(RESULTS_DIR / "int4_matmul.json", result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
