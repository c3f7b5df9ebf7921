"""The Triton W4A16 GEMM on a CUDA GPU: time and share of HBM bandwidth, beside dense bf16.

For Llama-3.1-8B's matmul shapes (4096x4096, 14336x4096, 4096x14336) and batches 1, 4, 16, 32
with bf16 activations, each round measures the device's copy bandwidth (a device-to-device copy
of COPY_BYTES: bytes read + bytes written / time) and then times, in turn: the packed kernel
(`packed_linear`), dequantize into a kept buffer + torch.matmul (the large-batch path), and
torch's dense bf16 F.linear on the same weights. Both paths run at every batch, so the table
shows where w4a16_linear's MAX_PACKED_ROWS should sit. Times are triton.testing.do_bench
medians: GPU time per call with the L2 cache flushed before each, so the weights come from HBM
as in a decode step; host launch overhead is not in them. Effective bandwidth = packed bytes
(codes, scales, mins) / time, given as a share of the copy bandwidth of its round; rows are
medians over the rounds.

    python -m benchmarks.kernels.triton_w4a16 [--quick] [--rounds 3]

Needs a CUDA device: without one it says so and exits 0. Writes
benchmarks/results/triton_w4a16.json and .md (docs/benchmarks.md's `<!-- bench:triton_w4a16 -->` block).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.report import RESULTS_DIR, write_results
from kernels.cpu import int4

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out, in): QKV-ish/O, gate|up, down
BATCHES = [1, 4, 16, 32]
GROUP_SIZE = 32
COPY_BYTES = 1 << 30  # far beyond any L2: the copy runs at HBM speed
ROUNDS = 3
WARMUP_MS = 25  # do_bench's warm-up and timed spans per measurement
REP_MS = 100


def copy_bandwidth(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once)."""
    from triton.testing import do_bench

    seconds = do_bench(lambda: dst.copy_(src), warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def measure(n: int, k: int, batches: list[int], rounds: int, copy_buffers: tuple) -> list[dict]:
    from triton.testing import do_bench

    from kernels.triton import w4a16

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    qweight, scales, mins = int4.quantize_rtn(torch.randn(n, k, device="cuda", generator=gen) * 0.02, GROUP_SIZE)
    dense = int4.dequantize(qweight, scales, mins, GROUP_SIZE).bfloat16()  # the same weights, dense
    buffer = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")  # the large-batch path's scratch
    packed_bytes = sum(t.numel() * t.element_size() for t in (qweight, scales, mins))
    rows = []
    for batch in batches:
        x = torch.randn(batch, k, device="cuda", generator=gen).bfloat16()
        candidates = {
            "packed": lambda: w4a16.packed_linear(x, qweight, scales, mins, GROUP_SIZE),
            "dequantize_gemm": lambda: torch.matmul(x, w4a16.dequantize_into(qweight, scales, mins, GROUP_SIZE,
                                                                             buffer).T),
            "dense_bf16": lambda: F.linear(x, dense),
        }
        samples: dict[str, list[float]] = {name: [] for name in ("copy_bw", *candidates)}
        for _ in range(rounds):
            samples["copy_bw"].append(copy_bandwidth(*copy_buffers))
            for name, run in candidates.items():  # in turn within a round: drift hits every path alike
                samples[name].append(do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / 1e3)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        chosen = "packed" if batch <= w4a16.MAX_PACKED_ROWS else "dequantize_gemm"
        effective = packed_bytes / medians[chosen]
        rows.append({"n": n, "k": k, "batch": batch, "copy_bw_gbs": medians["copy_bw"] / 1e9,
                     "packed_ms": medians["packed"] * 1e3, "dequantize_gemm_ms": medians["dequantize_gemm"] * 1e3,
                     "dense_bf16_ms": medians["dense_bf16"] * 1e3, "chosen": chosen,
                     "w4a16_gbs": effective / 1e9, "w4a16_share_of_copy_bw": effective / medians["copy_bw"]})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def to_markdown(result: dict) -> str:
    lines = [f"{result['device']}, triton {result['triton']}, torch {result['torch']}, bf16 x, group size "
             f"{GROUP_SIZE}, medians of {result['rounds']} rounds of do_bench medians (L2 flushed before each "
             f"call); copy BW: a 1 GiB device-to-device copy in the same rounds. w4a16 runs the packed kernel up "
             f"to {result['max_packed_rows']} rows, dequantize + GEMM above",
             "", "| out x in | batch | packed ms | dequantize + GEMM ms | dense bf16 ms | w4a16 GB/s | "
                 "% of copy BW | w4a16 vs dense bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        chosen_ms = row[f"{row['chosen']}_ms"]
        lines.append(f"| {row['n']}x{row['k']} | {row['batch']} | {row['packed_ms']:.3f} | "
                     f"{row['dequantize_gemm_ms']:.3f} | {row['dense_bf16_ms']:.3f} | {row['w4a16_gbs']:.0f} | "
                     f"{100 * row['w4a16_share_of_copy_bw']:.0f}% | {row['dense_bf16_ms'] / chosen_ms:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, batches 1 and 16")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per row (default {ROUNDS})")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        print("benchmarks/kernels/triton_w4a16.py needs a CUDA GPU and there is none here; nothing measured")
        return 0
    import triton

    from kernels.triton import w4a16

    shapes, batches = (SHAPES[:1], [1, 16]) if args.quick else (SHAPES, BATCHES)
    copy_buffers = (torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda"),
                    torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda"))
    rows = [row for n, k in shapes for row in measure(n, k, batches, args.rounds, copy_buffers)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rounds": args.rounds, "max_packed_rows": w4a16.MAX_PACKED_ROWS, "rows": rows}
    write_results(RESULTS_DIR / "triton_w4a16.json", result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
