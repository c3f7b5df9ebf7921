"""A CUDA decode step's host time against its GPU time, eager and replayed as a CUDA graph.

A preset model with seeded random weights on one GPU, random K/V, every sequence `--context-len`
tokens in. Per batch size, medians over `--steps` steps after a warm-up, the two ways interleaved:

- eager: the runner's eager path, inputs built as device tensors and the forward launched op by
  op. Host time: until the forward has been issued; step: until its logits are ready.
- graph: engine/runtime/cuda_graphs.py (inputs staged through pinned buffers, one replay).
- GPU time: CUDA events around a graph's step, where the kernels run back to back: the GPU's own
  time, the floor a step can reach. The target is host time below it (the host then keeps ahead).

    python -m benchmarks.gpu.decode_step_gpu [--model llama-3.1-8b] [--batches 1 4 16 64]
    python -m benchmarks.gpu.decode_step_gpu --quick --device cpu   (no GPU: the eager steps alone on a
        small model; exercises the script, measures nothing of a GPU)

On --device cuda without one it says so and exits 0. Writes
benchmarks/results/decode_step_gpu.json and .md (docs/benchmarks.md's `<!-- bench:decode_step_gpu -->` block).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import RESULTS_DIR, write_results
from engine import LLM
from engine.attention import AttentionMetadata
from engine.runtime.cuda_graphs import DecodeGraphs, DecodeRows
from scheduler.block_pool import blocks_for

RESULTS = RESULTS_DIR / "decode_step_gpu.json"


def decode_rows(batch: int, context_len: int, block_size: int) -> DecodeRows:
    """`batch` sequences, each with its own blocks (block 0 left unused), about to write token `context_len`."""
    num_blocks = blocks_for(context_len + 1, block_size)
    tables = [list(range(1 + row * num_blocks, 1 + (row + 1) * num_blocks)) for row in range(batch)]
    return DecodeRows([row % 1000 for row in range(batch)], [context_len] * batch, tables)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def eager_step(model, kv_cache, rows: DecodeRows, device) -> tuple[float, float]:
    """(host s, step s) of one eager step, inputs built as the runner's batch builder does."""
    start = time.perf_counter()
    meta = AttentionMetadata([], 0, torch.empty(0, dtype=torch.int64, device=device),
                             torch.empty(0, dtype=torch.int64, device=device),
                             decode_block_tables=torch.tensor(rows.block_tables, dtype=torch.int32, device=device),
                             decode_context_lens=torch.tensor([p + 1 for p in rows.positions], dtype=torch.int32,
                                                              device=device))
    model.forward(torch.tensor(rows.token_ids, device=device), torch.tensor(rows.positions, device=device),
                  kv_cache, meta, torch.tensor(range(len(rows)), device=device))
    issued = time.perf_counter()
    synchronize(device)
    return issued - start, time.perf_counter() - start


def graph_step(graphs: DecodeGraphs, rows: DecodeRows) -> tuple[float, float, float]:
    """(host s, step s, GPU s) of one replayed step."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    begin.record()
    graphs.run(rows)
    end.record()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return issued - start, time.perf_counter() - start, begin.elapsed_time(end) / 1e3


def measure(model, kv_cache, graphs: DecodeGraphs | None, rows: DecodeRows, steps: int) -> dict:
    """The medians of both ways; without graphs (not on CUDA) the eager way alone, the rest None."""
    for _ in range(3):  # warm-up: the bucket's graph captured, autotuning done
        eager_step(model, kv_cache, rows, model.device)
        if graphs is not None:
            graph_step(graphs, rows)
    eager, graph = [], []
    for _ in range(steps):
        eager.append(eager_step(model, kv_cache, rows, model.device))
        if graphs is not None:
            graph.append(graph_step(graphs, rows))

    def median_ms(samples, index):
        return 1e3 * statistics.median(s[index] for s in samples) if samples else None

    return {"batch": len(rows), "eager_host_ms": median_ms(eager, 0), "eager_step_ms": median_ms(eager, 1),
            "graph_host_ms": median_ms(graph, 0), "graph_step_ms": median_ms(graph, 1),
            "gpu_ms": median_ms(graph, 2)}


def to_markdown(result: dict) -> str:
    setup = result["setup"]
    lines = [f"{setup['device']}, {setup['model']} (random weights, {setup['dtype']}), every sequence "
             f"{setup['context_len']} tokens in, host {setup['host']}, medians of {setup['steps']} steps", "",
             "| batch | eager host ms | eager step ms | graph host ms | graph step ms | GPU ms | "
             "step eager / graph | graph host / GPU |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        if row["graph_step_ms"] is None:  # no CUDA: the eager columns alone
            lines.append(f"| {row['batch']} | {row['eager_host_ms']:.2f} | {row['eager_step_ms']:.2f} | - | - | - | - | - |")
            continue
        lines.append(f"| {row['batch']} | {row['eager_host_ms']:.2f} | {row['eager_step_ms']:.2f} | "
                     f"{row['graph_host_ms']:.2f} | {row['graph_step_ms']:.2f} | {row['gpu_ms']:.2f} | "
                     f"**{row['eager_step_ms'] / row['graph_step_ms']:.2f}x** | "
                     f"{row['graph_host_ms'] / row['gpu_ms']:.2f} |")
    return "\n".join(lines) + "\n"


QUICK = {"model": "smollm2-135m", "batches": [1, 4], "context_len": 64, "steps": 3}  # --quick's sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a preset in configs/models")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none", choices=["none", "int4"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the eager steps alone (no CUDA graphs there)")
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("decode_step_gpu.py needs a CUDA device; nothing measured", file=sys.stderr)
        return 0
    max_batch, block_size = max(args.batches), 16
    num_blocks = 1 + max_batch * blocks_for(args.context_len + 1, block_size)
    with LLM(model=args.model, load_format="dummy", dtype=args.dtype, quantization=args.quantization,
             device=args.device, cpu_attention="off", max_num_seqs=max_batch, max_model_len=args.context_len + 1,
             block_size=block_size, num_blocks=num_blocks, show_progress=True) as llm:
        model, kv_cache = llm.engine.runner.model, llm.engine.runner.kv_cache
        kv_cache.gpu.fill_random()
        graphs = (DecodeGraphs(model, kv_cache, max_batch, blocks_for(args.context_len + 1, block_size))
                  if args.device == "cuda" else None)
        with torch.inference_mode():
            rows = [measure(model, kv_cache, graphs, decode_rows(batch, args.context_len, block_size), args.steps)
                    for batch in args.batches]
    setup = {key: getattr(args, key) for key in ("model", "dtype", "quantization", "context_len", "steps")}
    setup.update(device=torch.cuda.get_device_name() if args.device == "cuda" else "CPU (eager only)",
                 host=f"{platform.machine()} {os.cpu_count()} CPUs")
    result = {"setup": setup, "rows": rows}
    markdown = to_markdown(result)
    write_results(args.output, result, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
