"""The Triton W4A16 GEMM on a CUDA GPU: time and share of HBM bandwidth, beside dense bf16 and the
maintained int4 kernels a user would reach for.

For Llama-3.1-8B's matmul shapes (4096x4096, 14336x4096, 4096x14336) and batches 1, 4, 16, 32
with bf16 activations, each round measures the device's copy bandwidth (a device-to-device copy
of COPY_BYTES: bytes read + bytes written / time) and then times, in turn: the packed kernel
(`packed_linear`, its split-k schedule timed once per shape before the rounds), dequantize into a
kept buffer + torch.matmul (the large-batch path), torch's dense bf16 F.linear on the same weights,
and where they import: torch's tinygemm int4 matmul (`torch._weight_int4pack_mm`, scales and zeros
in bf16: it rounds the format's fp16 scales and mins, so each row states its error against the
exact product) and gemlite (`GemLiteLinear`, zeros as fp16 `-min / scale`: rounded too). Scales and
mins are fp16, as GGUF Q4_0/Q4_1 store them (the engine keeps them so). Both of our paths run at
every batch, so the table shows where w4a16_linear's MAX_PACKED_ROWS should sit. Times are
triton.testing.do_bench medians: GPU time per call with the L2 cache flushed before each, so the
weights come from HBM as in a decode step; host launch overhead is not in them. Effective
bandwidth = packed bytes (codes, scales, mins) / time, given as a share of the copy bandwidth of
its round; rows are medians over the rounds.

    python -m benchmarks.kernels.triton_w4a16 [--quick] [--rounds 3]
    python -m benchmarks.kernels.triton_w4a16 --quick --device cpu   (no GPU: Triton's interpreter on a
        small shape, wall-clock times: exercises the script, measures nothing of a GPU)

On --device cuda without one it says so and exits 0. Writes benchmarks/results/triton_w4a16.json
and .md (docs/benchmarks.md's `<!-- bench:triton_w4a16 -->` block), or --output.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.report import RESULTS_DIR, write_results
from engine.profiling.profiler import median_seconds
from kernels.cpu import int4

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (out, in): QKV-ish/O, gate|up, down
BATCHES = [1, 4, 16, 32]
CPU_SHAPE = (192, 256)  # --device cpu: every program instance runs in Python
CPU_REPEATS = 3  # wall-clock calls per measurement on the CPU (median)
CPU_COPY_BYTES = 1 << 24
TINYGEMM_INNER_K_TILES = 8  # torch's int4pack layout parameter (2, 4 or 8)
GROUP_SIZE = 32
COPY_BYTES = 1 << 30  # far beyond any L2: the copy runs at HBM speed
ROUNDS = 3
WARMUP_MS = 25  # do_bench's warm-up and timed spans per measurement
REP_MS = 100


def time_s(run, device: str) -> float:
    """Seconds per call: do_bench's median GPU time on cuda, a wall-clock median on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median") / 1e3
    return median_seconds(run, warmup=1, repetitions=CPU_REPEATS)  # the warm-up builds the interpreter's kernels


def copy_bandwidth(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once and written once)."""
    return 2 * src.numel() * src.element_size() / time_s(lambda: dst.copy_(src), src.device.type)


def fp16_weight(n: int, k: int, device: str, gen: torch.Generator) -> tuple:
    """(qweight, scales, mins) with fp16 scales and mins (as GGUF Q4_0/Q4_1 hold them) and the
    fp32 [n, k] matrix they stand for."""
    qweight, scales, mins = int4.quantize_rtn(torch.randn(n, k, device=device, generator=gen) * 0.02, GROUP_SIZE)
    scales, mins = scales.half(), mins.half()
    return qweight, scales, mins, int4.dequantize(qweight, scales.float(), mins.float(), GROUP_SIZE)


def tinygemm(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """torch's int4 matmul on the same weight: its layout wants levels packed two a byte, even
    element high, and [k / group, n, 2] bf16 (scale, zero) with w = (q - 8) * scale + zero."""
    levels = int4.unpack(qweight).int()  # [n, k]
    packed = torch._convert_weight_to_int4pack((levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8),
                                               TINYGEMM_INNER_K_TILES)
    zeros = mins.float() + 8 * scales.float()
    scales_and_zeros = torch.stack([scales.float(), zeros], dim=2).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch._weight_int4pack_mm(x, packed, GROUP_SIZE, scales_and_zeros)


def gemlite_linear(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor):
    """gemlite's layer on the same weight: HQQ's form (q - zero) * scale, zero = -min / scale."""
    from gemlite import DType, GemLiteLinear

    n, k = qweight.shape[0], qweight.shape[1] * 2
    layer = GemLiteLinear(4, group_size=GROUP_SIZE, in_features=k, out_features=n, input_dtype=DType.BF16,
                          output_dtype=DType.BF16)
    zeros = -mins.float() / scales.float()
    layer.pack(int4.unpack(qweight), scales.view(-1, 1), zeros.half().view(-1, 1), None)
    return layer


def peers(qweight, scales, mins, device: str) -> dict:
    """The maintained kernels that build here: name -> (x -> y), or the reason one does not."""
    if device != "cuda":
        return {}
    found = {}
    for name, make in (("torch_int4pack", tinygemm), ("gemlite", gemlite_linear)):
        try:
            found[name] = make(qweight, scales, mins)
        except Exception as exc:  # a missing package or an API of another version: a row says so
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def measure(n: int, k: int, batches: list[int], rounds: int, copy_buffers: tuple, device: str) -> list[dict]:
    from kernels.triton import w4a16

    gen = torch.Generator(device=device).manual_seed(n + k)
    qweight, scales, mins, exact = fp16_weight(n, k, device, gen)
    dense = exact.to(torch.bfloat16 if device == "cuda" else torch.float32)  # the same weights, dense
    buffer = torch.empty(n, k, dtype=dense.dtype, device=device)  # the large-batch path's scratch
    packed_bytes = sum(t.numel() * t.element_size() for t in (qweight, scales, mins))
    others = peers(qweight, scales, mins, device)
    rows = []
    for batch in batches:
        x = torch.randn(batch, k, device=device, generator=gen).to(dense.dtype)
        schedule = w4a16.schedule_for(x, qweight, scales, mins, GROUP_SIZE)  # timed once, outside the rounds
        candidates = {
            "packed": lambda: w4a16.packed_linear(x, qweight, scales, mins, GROUP_SIZE),
            "dequantize_gemm": lambda: torch.matmul(x, w4a16.dequantize_into(qweight, scales, mins, GROUP_SIZE,
                                                                             buffer).T),
            "dense_bf16": lambda: F.linear(x, dense),
            **{name: (lambda run=run: run(x)) for name, run in others.items() if callable(run)},
        }
        errors = {name: relative_error(run(), x.float() @ exact.T) for name, run in candidates.items()}
        samples: dict[str, list[float]] = {name: [] for name in ("copy_bw", *candidates)}
        for _ in range(rounds):
            samples["copy_bw"].append(copy_bandwidth(*copy_buffers))
            for name, run in candidates.items():  # in turn within a round: drift hits every path alike
                samples[name].append(time_s(run, device))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        chosen = "packed" if batch <= w4a16.MAX_PACKED_ROWS else "dequantize_gemm"
        effective = packed_bytes / medians[chosen]
        rows.append({"n": n, "k": k, "batch": batch, "copy_bw_gbs": medians["copy_bw"] / 1e9,
                     "packed_ms": medians["packed"] * 1e3, "dequantize_gemm_ms": medians["dequantize_gemm"] * 1e3,
                     "dense_bf16_ms": medians["dense_bf16"] * 1e3, "chosen": chosen, "schedule": str(schedule),
                     "w4a16_gbs": effective / 1e9, "w4a16_share_of_copy_bw": effective / medians["copy_bw"],
                     "peers": {name: ({"ms": medians[name] * 1e3, "relative_error": errors[name]}
                                      if name in medians else {"unavailable": run})
                               for name, run in others.items()},
                     "relative_error": errors[chosen]})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |actual - expected| over max |expected|."""
    return float((actual.float() - expected).abs().max() / expected.abs().max())


def to_markdown(result: dict) -> str:
    dtype = result.get("x_dtype", "bf16")
    peer_names = list(result["rows"][0].get("peers", {})) if result["rows"] else []
    timing = ("do_bench medians (L2 flushed before each call); copy BW: a 1 GiB device-to-device copy"
              if result.get("on_cuda", True) else "wall-clock medians under Triton's interpreter; copy BW: a "
                                                   "16 MiB host copy")
    lines = [f"{result['device']}, triton {result['triton']}, torch {result['torch']}, {dtype} x, group size "
             f"{GROUP_SIZE}, fp16 scales and mins, medians of {result['rounds']} rounds of {timing} in the same "
             f"rounds. w4a16 runs the packed kernel up to {result['max_packed_rows']} rows, dequantize + GEMM above"
             + ("; peers: ms (max error relative to the exact product's largest value)" if peer_names else ""),
             "", f"| out x in | batch | packed ms | dequantize + GEMM ms | dense {dtype} ms | w4a16 GB/s | "
                 f"% of copy BW | w4a16 vs dense {dtype} |" + "".join(f" {name} |" for name in peer_names),
             "|---|---|---|---|---|---|---|---|" + "---|" * len(peer_names)]
    for row in result["rows"]:
        chosen_ms = row[f"{row['chosen']}_ms"]
        lines.append(f"| {row['n']}x{row['k']} | {row['batch']} | {row['packed_ms']:.3f} | "
                     f"{row['dequantize_gemm_ms']:.3f} | {row['dense_bf16_ms']:.3f} | {row['w4a16_gbs']:.0f} | "
                     f"{100 * row['w4a16_share_of_copy_bw']:.0f}% | {row['dense_bf16_ms'] / chosen_ms:.2f}x |"
                     + "".join(f" {peer_cell(row['peers'][name])} |" for name in peer_names))
    return "\n".join(lines) + "\n"


def peer_cell(peer: dict) -> str:
    if "unavailable" in peer:
        return f"- ({peer['unavailable'][:60]})"
    return f"{peer['ms']:.3f} ({peer['relative_error']:.1e})"


def import_kernels(device: str):
    """kernels.triton.w4a16 compiled for cuda, or built for Triton's interpreter on the CPU."""
    import triton

    if device == "cuda":
        from kernels.triton import w4a16
        return w4a16
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        from kernels.triton import w4a16
    return w4a16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape, batches 1 and 16")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds per row (default {ROUNDS})")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: Triton's interpreter on a small shape (the script exercised, nothing measured)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "triton_w4a16.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("benchmarks/kernels/triton_w4a16.py needs a CUDA GPU and there is none here; nothing measured")
        return 0
    import triton

    w4a16 = import_kernels(args.device)
    if on_cuda:
        shapes, batches = (SHAPES[:1], [1, 16]) if args.quick else (SHAPES, BATCHES)
    else:
        shapes, batches = [CPU_SHAPE], [1, w4a16.MAX_PACKED_ROWS + 1] if args.quick else [1, 4, 16, 32]
    copy_bytes = COPY_BYTES if on_cuda else CPU_COPY_BYTES
    copy_buffers = (torch.empty(copy_bytes, dtype=torch.uint8, device=args.device),
                    torch.empty(copy_bytes, dtype=torch.uint8, device=args.device))
    rows = [row for n, k in shapes for row in measure(n, k, batches, args.rounds, copy_buffers, args.device)]
    result = {"device": torch.cuda.get_device_name() if on_cuda else "CPU (Triton's interpreter)",
              "on_cuda": on_cuda, "x_dtype": "bf16" if on_cuda else "fp32", "torch": torch.__version__,
              "triton": triton.__version__, "rounds": args.rounds, "max_packed_rows": w4a16.MAX_PACKED_ROWS,
              "rows": rows}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
