"""Llama-3.1-70B over 2-4 nodes of one 24 GB GPU each: tensor parallelism against pipeline stages
on 1 and 10 Gbit/s Ethernet, in simulated time (scheduler/simulation/cluster.py).

Each node is the A10G profile (configs/hardware/a10g-g5.4xlarge.json: 24 GB, 600 GB/s) holding
1 / nodes of the INT4 weights (tandem's format: 4-bit codes, an fp32 scale and minimum per 32) and
of the workload's KV; what does not fit streams from host memory over PCIe under the layers. The
real scheduler drives each layout through the same workload, GPU-only. `make bench-multinode` checks
the same model against a measured two-node run (its TP/PP ratio).

    .venv/bin/python -m benchmarks.simulation.simulate_cluster
Writes benchmarks/results/simulate_cluster.json and .md (docs/benchmarks.md's block).
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.report import RESULTS_DIR, write_results
from engine.model_config import load_model_preset
from scheduler.planning.memory import INT4_GROUP_SIZE, INT4_PARAM_BYTES
from scheduler.simulation.cluster import Layout, Link, simulate_cluster
from scheduler.simulation.roofline import HardwareProfile
from scheduler.simulation.simulator import SimulationResult, Workload

RESULTS = RESULTS_DIR / "simulate_cluster.json"
MODEL = "llama-3.1-70b"
NODE = "a10g-g5.4xlarge"
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * INT4_PARAM_BYTES / INT4_GROUP_SIZE  # codes, scale and minimum
# A ring step's software cost beyond the wire (NCCL's socket transport: its proxy thread's send
# and the kernel's wait), assumed, not measured here; the testbed's gloo on one core measures
# ~0.17 ms (make bench-multinode), the per-call cost of a whole process waking up.
CALL_S = 25e-6
LINKS = (
    # TCP payload rates of the line rates; one-way latencies of a switched LAN hop with kernel TCP
    Link("1 GbE", 0.94, 50e-6, CALL_S),
    Link("10 GbE", 9.4, 20e-6, CALL_S),
)
LAYOUTS = {2: (Layout(2, 1), Layout(1, 2)),
           3: (Layout(3, 1), Layout(1, 3)),
           4: (Layout(4, 1), Layout(1, 4), Layout(2, 2))}
# Decode-heavy chat: short prompts, long answers, all at once; few users and many.
INPUT_LEN, OUTPUT_LEN = 128, 256
BATCHES = (4, 32)


def decode_tpot_s(result: SimulationResult) -> float:
    """Median over requests of their time per output token after the first."""
    return statistics.median((r.finish_time - r.first_token_time) / max(r.num_output_tokens - 1, 1)
                             for r in result.records)


def run() -> dict:
    shape, dtype_bytes = load_model_preset(MODEL)
    node = HardwareProfile.load(NODE)
    rows = []
    for link in LINKS:
        for num_nodes, layouts in LAYOUTS.items():
            for layout in layouts:
                row = {"link": link.name, "nodes": num_nodes, "layout": layout.describe()}
                for batch in BATCHES:
                    result, memory = simulate_cluster(shape, node, layout, link, Workload(batch, INPUT_LEN, OUTPUT_LEN),
                                                      dtype_bytes=dtype_bytes,
                                                      weight_element_bytes=INT4_BYTES_PER_WEIGHT)
                    row[f"streamed_gib_{batch}"] = memory.streamed_gib
                    row[f"throughput_{batch}"] = result.output_throughput
                    row[f"tpot_s_{batch}"] = decode_tpot_s(result)
                rows.append(row)
    return {"model": MODEL, "node": NODE, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "batches": BATCHES,
            "links": [vars(link) for link in LINKS], "rows": rows}


def markdown(result: dict) -> str:
    small, large = result["batches"]
    lines = [f"{result['model']} (INT4 weights) on one-GPU nodes of the {result['node']} profile (24 GB), "
             f"{result['input_len']}-token prompts and {result['output_len']}-token answers, all at once; "
             f"GPU-only, stages in turn; a ring step costs {1e6 * CALL_S:.0f} us beyond the wire.", "",
             f"| link | nodes | layout | streamed GiB a node | out tok/s, {small} streams | TPOT ms | "
             f"out tok/s, {large} streams | TPOT ms |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['link']} | {row['nodes']} | {row['layout']} | {row[f'streamed_gib_{large}']:.1f} | "
                     f"{row[f'throughput_{small}']:.1f} | {1e3 * row[f'tpot_s_{small}']:.0f} | "
                     f"{row[f'throughput_{large}']:.1f} | {1e3 * row[f'tpot_s_{large}']:.0f} |")
    return "\n".join([*lines, "", *ratio_lines(result), ""])


def ratio_lines(result: dict) -> list[str]:
    """Pipeline over tensor parallelism at the same node count and link."""
    small, large = result["batches"]
    by_key = {(row["link"], row["nodes"], row["layout"]): row for row in result["rows"]}
    lines = [f"| link | nodes | pp / tp output tokens/s, {small} streams | {large} streams |", "|---|---:|---:|---:|"]
    for (link, nodes, layout), row in by_key.items():
        if layout != f"tp {nodes} x pp 1":
            continue
        pp = by_key[(link, nodes, f"tp 1 x pp {nodes}")]
        lines.append(f"| {link} | {nodes} | {pp[f'throughput_{small}'] / row[f'throughput_{small}']:.2f}x | "
                     f"{pp[f'throughput_{large}'] / row[f'throughput_{large}']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    result = run()
    write_results(RESULTS, result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
