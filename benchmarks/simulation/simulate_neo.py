"""Neo fig. 9 in simulation: tandem's output throughput over its GPU-only mode on Neo's machines.

For each of Neo's three setups (T4 + Llama-2-7B, A10G + Llama-3.1-8B, 2xH100 + Llama-3.1-70B) this
runs Neo's synthetic workload (fixed input length, output lengths swept, both +-10% uniform, all
requests at once) through the real NeoScheduler in simulated time (scheduler/simulation/simulator.py) with
the roofline cost model of the machine's datasheet profile (configs/hardware/), once with the host
KV pool and once without it (GPU-only), and prints the ratio beside Neo's published peak gains.

    .venv/bin/python -m benchmarks.simulation.simulate_neo [--quick]
Prints a markdown table and writes benchmarks/results/simulate_neo.json and .md (docs/benchmarks.md's
`<!-- bench:simulate_neo -->` block).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from benchmarks.report import RESULTS_DIR
from engine.model_config import load_model_preset
from scheduler.planning.kv_format import kv_format
from scheduler.neo import NeoKnobs
from scheduler.simulation.roofline import HardwareProfile, RooflineCostModel, size_pools
from scheduler.simulation.simulator import Comparison, Workload, compare

RESULTS = RESULTS_DIR / "simulate_neo.json"


@dataclass(frozen=True)
class Setup:
    hardware: str
    model: str
    input_len: int
    why_input: str  # where the input length comes from
    paper_peak: float  # Neo's published peak relative throughput over GPU-only (fig. 9, section 5.4)


SETUPS = (
    Setup("t4-g4dn.4xlarge", "llama-2-7b", 500,
          "short prompts, as in the OSC trace Neo served on the T4", 7.5),
    Setup("a10g-g5.4xlarge", "llama-3.1-8b", 1000,
          "Neo artifact's fig. 10a sweep: input 1000, outputs 50-400", 1.26),
    Setup("2xh100-xeon8462y", "llama-3.1-70b", 2000,
          "Neo fig. 8b fixes the input at 2000 on 2xH100", 1.14),
)
OUTPUT_LENS = (50, 100, 200, 300, 400)  # Neo artifact's fig. 10a sweep
# Neo's fig. 10a script sends 2000 requests and warns against fewer than 800: fewer leave the
# run dominated by its start (everything prefilling) and its drain (a few stragglers).
NUM_REQUESTS = 800
QUICK_NUM_REQUESTS = 200
QUICK_OUTPUT_LENS = (50, 200, 400)
SEED = 0
# The floor: offloading may not cost more than 2% against GPU-only.
MIN_RELATIVE = 0.98
# Ablation of the scheduler's bounded wait: so many iterations that no CPU decode is ever placed
# past Neo's inequalities because it waited (the paper's scheduler has no such bound).
UNBOUNDED_WAIT = 10**9
# Sensitivity of the T4 result to its GPU pool: a pool of this many 16-token blocks (864 tokens)
# leaves GPU-only one 500-token request at a time.
T4_SMALL_POOL_BLOCKS = 54
T4_SMALL_POOL_OUTPUTS = (100, 200)  # 550 + 220 tokens still fit in 864


def run_setup(setup: Setup, output_lens, num_requests: int) -> list[dict]:
    shape, dtype_bytes = load_model_preset(setup.model)
    hardware = HardwareProfile.load(setup.hardware)
    rows = []
    for output_len in output_lens:
        workload = Workload(num_requests, setup.input_len, output_len, seed=SEED)
        start = time.perf_counter()
        comparison = compare(shape, hardware, workload, dtype_bytes=dtype_bytes)
        ablation = compare(shape, hardware, workload, dtype_bytes=dtype_bytes,
                           neo=NeoKnobs(max_cpu_wait_iterations=UNBOUNDED_WAIT))
        rows.append(row_of(setup, workload, comparison, ablation, time.perf_counter() - start))
        print(format_row(rows[-1]), flush=True)
    return rows


def row_of(setup: Setup, workload: Workload, comparison: Comparison, ablation: Comparison, wall_s: float) -> dict:
    tandem, gpu_only = comparison.tandem, comparison.gpu_only
    return {
        "hardware": setup.hardware,
        "model": setup.model,
        "input_len": workload.input_len,
        "output_len": workload.output_len,
        "num_requests": workload.num_requests,
        "num_gpu_blocks": comparison.setup.num_gpu_blocks,
        "num_cpu_blocks": comparison.setup.num_cpu_blocks,
        "relative_throughput": comparison.relative_throughput,
        "relative_throughput_unbounded_wait": ablation.relative_throughput,
        "tandem": tandem.summary(),
        "gpu_only": gpu_only.summary(),
        "wall_s": wall_s,
    }


def format_row(row: dict) -> str:
    tandem, gpu_only = row["tandem"], row["gpu_only"]
    modes = tandem["iterations_by_mode"]
    pipelined_share = modes.get("pipelined", 0) / max(tandem["num_iterations"], 1)
    return (f"| {row['hardware']} | {row['model']} | {row['input_len']} | {row['output_len']} | "
            f"{gpu_only['output_throughput']:.0f} | {tandem['output_throughput']:.0f} | "
            f"**{row['relative_throughput']:.2f}x** | {row['relative_throughput_unbounded_wait']:.2f}x | "
            f"{gpu_only['mean_gpu_batch']:.1f} | {tandem['mean_gpu_batch']:.1f} + {tandem['mean_cpu_batch']:.1f} | "
            f"{pipelined_share:.0%} | {tandem['num_swap_out']}/{tandem['num_swap_in']} | "
            f"{tandem['num_forced']} | {tandem['peak_cpu_requests']} | "
            f"{gpu_only['per_token_latency_p50_s'] * 1e3:.0f} / "
            f"{tandem['per_token_latency_p50_s'] * 1e3:.0f} |")


HEADER = ("| machine | model | input | output | GPU-only tok/s | tandem tok/s | relative | relative, no wait bound "
          "| GPU-only batch | tandem batch GPU + CPU | pipelined iterations | swaps out/in | forced CPU decodes "
          "| peak CPU-requests | p50 per-token ms GPU-only / tandem |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def machine_facts(setup: Setup) -> dict:
    """The numbers that decide how much offloading can give on this machine."""
    shape, dtype_bytes = load_model_preset(setup.model)
    hardware = HardwareProfile.load(setup.hardware)
    cost = RooflineCostModel(shape, hardware, dtype_bytes)
    pools = size_pools(shape, hardware, dtype_bytes=dtype_bytes)
    kv_bytes = shape.kv_bytes_per_token_layer(dtype_bytes)
    decode_linear = cost.linear(1)  # a decode step's T_l: the layer's weights read once
    context = setup.input_len + max(OUTPUT_LENS) // 2  # a typical request's context mid-decode
    gpu_requests = pools.num_gpu_blocks * 16 // context
    # a batch-0 carrying one prompt and the GPU's decodes: the CPU requests batch-1 can then hide
    prefill_linear = cost.linear(setup.input_len + gpu_requests)
    prefill_hides = prefill_linear * hardware.host_bandwidth / kv_bytes / context
    return {
        "gpu_kv_tokens": pools.num_gpu_blocks * 16,
        "gpu_requests": gpu_requests,
        "prefill_linear_ms": prefill_linear * 1e3,
        "cpu_requests_per_prefill": prefill_hides,
        "cpu_requests_per_prefill_over_gpu_requests": prefill_hides / max(gpu_requests, 1),
        "linear_ridge_tokens": cost.linear_ridge_tokens,
        "decode_linear_ms": decode_linear * 1e3,
        # context tokens the CPU reads in one decode step's T_l: what one sub-batch can hide
        "cpu_tokens_per_decode_linear": int(decode_linear * hardware.host_bandwidth / kv_bytes),
        "host_bandwidth_gbps": hardware.host_bandwidth / 1e9,
        "gpu_bandwidth_gbps": hardware.num_gpus * hardware.gpu_bandwidth / 1e9,
    }


def summarize(rows: list[dict]) -> list[dict]:
    summary = []
    for setup in SETUPS:
        mine = [r for r in rows if r["hardware"] == setup.hardware]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["relative_throughput"])
        summary.append({"hardware": setup.hardware, "model": setup.model, "input_len": setup.input_len,
                        "peak_relative": best["relative_throughput"], "peak_output_len": best["output_len"],
                        "min_relative": min(r["relative_throughput"] for r in mine),
                        "peak_relative_unbounded_wait": max(r["relative_throughput_unbounded_wait"] for r in mine),
                        "min_relative_unbounded_wait": min(r["relative_throughput_unbounded_wait"] for r in mine),
                        "paper_peak": setup.paper_peak, "why_input": setup.why_input,
                        **machine_facts(setup)})
    return summary


def t4_small_pool(num_requests: int) -> list[dict]:
    setup = SETUPS[0]
    shape, dtype_bytes = load_model_preset(setup.model)
    hardware = HardwareProfile.load(setup.hardware)
    rows = []
    for output_len in T4_SMALL_POOL_OUTPUTS:
        workload = Workload(num_requests, setup.input_len, output_len, seed=SEED)
        comparison = compare(shape, hardware, workload, dtype_bytes=dtype_bytes, num_gpu_blocks=T4_SMALL_POOL_BLOCKS)
        rows.append({"output_len": output_len, "num_gpu_blocks": T4_SMALL_POOL_BLOCKS,
                     "relative_throughput": comparison.relative_throughput,
                     "gpu_only_batch": comparison.gpu_only.mean_gpu_batch})
    return rows


def markdown(rows: list[dict], summary: list[dict], small_pool: list[dict], num_requests: int) -> list[str]:
    lines = [f"Simulated (scheduler/simulation/simulator.py: the real NeoScheduler, roofline costs from datasheet profiles in "
             f"configs/hardware/), {num_requests} requests at once per run, lengths +-10% uniform, seed {SEED}. "
             f"\"relative\" is tandem's output throughput over its GPU-only mode (`num_cpu_blocks=0`); with every "
             f"request arriving at once, per-token latency is mostly queueing.", ""]
    lines += ["| machine | model | input | tandem peak (at output) | tandem lowest | Neo's published peak |",
              "|---|---|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['hardware']} | {s['model']} | {s['input_len']} | **{s['peak_relative']:.2f}x** "
                     f"({s['peak_output_len']}) | {s['min_relative']:.2f}x | {s['paper_peak']:.2f}x |")
    peaks = [s["peak_relative"] for s in summary]
    ordered = all(a > b for a, b in zip(peaks, peaks[1:]))
    lowest = min(s["min_relative"] for s in summary)
    lines += ["", f"- Paper's order T4 > A10G > H100: **{'yes' if ordered else 'no'}** "
                  f"({' > '.join(f'{p:.2f}x' for p in peaks)}).",
              f"- Never below {MIN_RELATIVE}x GPU-only: **{'yes' if lowest >= MIN_RELATIVE else 'no'}** "
              f"(lowest {lowest:.2f}x)."]
    if lowest < MIN_RELATIVE:
        worst = min(rows, key=lambda r: r["relative_throughput"])
        facts = next(s for s in summary if s["hardware"] == worst["hardware"])
        hidden = facts["cpu_tokens_per_decode_linear"] // (worst["input_len"] + worst["output_len"] // 2)
        lowest_unbounded = min(s["min_relative_unbounded_wait"] for s in summary)
        cause = (f"  With the scheduler's bounded wait lifted (`max_cpu_wait_iterations` unbounded, column "
                 f"\"relative, no wait bound\") the lowest ratio is {lowest_unbounded:.2f}x, so the shortfall "
                 f"comes from that policy, not from the cost model." if lowest_unbounded >= MIN_RELATIVE else
                 f"  With the scheduler's bounded wait lifted the lowest ratio is still {lowest_unbounded:.2f}x.")
        lines.append(
            f"{cause} In the worst run ({worst['hardware']}, output {worst['output_len']}) the CPU runqueue peaked at "
            f"{worst['tandem']['peak_cpu_requests']} requests while a decode-only step hides the CPU attention of "
            f"about {hidden} of them; "
            f"pipelining such a step loses to GPU-only, so the step runs GPU-only and every CPU-request waits, "
            f"their waits run out together after {NeoKnobs().max_cpu_wait_iterations} iterations, and "
            f"{worst['tandem']['num_forced']} CPU decodes were placed past Neo's inequalities in iterations whose "
            f"CPU attention stalls the GPU.")
    lines += ["", HEADER, *(format_row(r) for r in rows), ""]
    lines += ["Why the simulated gains differ from Neo's measured ones:", ""]
    facts = {s["hardware"]: s for s in summary}
    t4, a10g, h100 = (facts.get(s.hardware) for s in SETUPS)
    if t4:
        small = ", ".join(f"{r['relative_throughput']:.1f}x at output {r['output_len']}" for r in small_pool)
        lines.append(
            f"- **T4** (paper 7.5x, here {t4['peak_relative']:.1f}x): the gain is set by how few requests the GPU "
            f"pool holds. Sized from the datasheet (90% of 15 GiB less 12.6 GiB of fp16 weights and the "
            f"activations) it holds {t4['gpu_kv_tokens']} KV tokens, about two requests, while one decode step's "
            f"weight read ({t4['decode_linear_ms']:.1f} ms a layer) hides the CPU's attention over "
            f"{t4['cpu_tokens_per_decode_linear']} context tokens per sub-batch. Neo sized its pools by profiling "
            f"the real T4, and the paper does not give the sizes; with a {T4_SMALL_POOL_BLOCKS}-block pool "
            f"({T4_SMALL_POOL_BLOCKS * 16} tokens, GPU-only one request at a time) the simulation gives {small}.")
    if a10g:
        lines.append(
            f"- **A10G** (paper 1.26x in fig. 9, 1.13x for the same g5.4xlarge in fig. 10a; here "
            f"{a10g['peak_relative']:.2f}x): the host reads {a10g['host_bandwidth_gbps']:.0f} GB/s (one Zen 2 CCD's "
            f"Infinity Fabric link at 70%) against the GPU's {a10g['gpu_bandwidth_gbps']:.0f}. A decode-only step's "
            f"T_l ({a10g['decode_linear_ms']:.2f} ms a layer) hides {a10g['cpu_tokens_per_decode_linear']} CPU "
            f"context tokens per sub-batch, about {a10g['cpu_tokens_per_decode_linear'] // (a10g['input_len'] + 200)} "
            f"requests beside the {a10g['gpu_requests']} the GPU holds, and batch-1's T_l reads all the weights "
            f"again, so pipelining a decode-only step loses to GPU-only; the gain has to come from iterations with "
            f"a prefill, whose T_l0 ({a10g['prefill_linear_ms']:.1f} ms) hides about "
            f"{a10g['cpu_requests_per_prefill']:.0f} CPU decodes "
            f"({a10g['cpu_requests_per_prefill_over_gpu_requests']:.1f}x the GPU's batch).")
    if h100:
        lines.append(
            f"- **2xH100** (paper 1.14x, here {h100['peak_relative']:.2f}x): two GPUs read weights at "
            f"{h100['gpu_bandwidth_gbps']:.0f} GB/s, so a decode step's T_l is {h100['decode_linear_ms']:.2f} ms "
            f"and hides {h100['cpu_tokens_per_decode_linear']} CPU context tokens (about "
            f"{h100['cpu_tokens_per_decode_linear'] // (h100['input_len'] + 200)} requests) from one NUMA node's "
            f"{h100['host_bandwidth_gbps']:.0f} GB/s. A prefill's T_l0 ({h100['prefill_linear_ms']:.1f} ms) hides "
            f"about {h100['cpu_requests_per_prefill']:.0f} CPU decodes "
            f"({h100['cpu_requests_per_prefill_over_gpu_requests']:.1f}x the GPU's batch"
            + (f", against {a10g['cpu_requests_per_prefill_over_gpu_requests']:.1f}x on the A10G" if a10g else "")
            + "), so from datasheet numbers the two machines have similar room for offloading; Neo "
            f"names what the roofline leaves out and what weighs most on the H100's sub-millisecond layers: Python "
            f"kernel-launch overhead under the GIL (twice per layer when pipelined) and its less tuned "
            f"tensor-parallel path (8.8% behind vLLM, section 5.5). Here a launch costs a fixed few microseconds.")
    lines += [
        "- Everywhere: the profiles use datasheet peaks times fixed achievable fractions (each noted in its "
        "JSON), not bandwidths measured on Neo's machines, and CPU attention is modelled as pure DRAM streaming "
        "(Neo's ISPC kernel is not). The constants were set from the datasheets before these runs, not fitted to "
        "the paper. Neo's baseline is its own GPU-only mode (SwiftLLM), as here.",
    ]
    return lines


# Neo's T4 and A10G cases with the KV cache in INT8 beside 16 bits (same GPUs, same memory).
KV_FORMAT_SETUPS = ("t4-g4dn.4xlarge", "a10g-g5.4xlarge")
KV_FORMAT_OUTPUTS = (100, 300)


def kv_format_rows(num_requests: int) -> list[dict]:
    """Per setup and output length: tandem and GPU-only with 16-bit and INT8 KV, and INT8 tandem
    over 16-bit GPU-only (the gain a user sees from both mechanisms)."""
    rows = []
    for setup in (s for s in SETUPS if s.hardware in KV_FORMAT_SETUPS):
        shape, dtype_bytes = load_model_preset(setup.model)
        hardware = HardwareProfile.load(setup.hardware)
        for output_len in KV_FORMAT_OUTPUTS:
            workload = Workload(num_requests, setup.input_len, output_len, seed=SEED)
            runs = {name: compare(shape, hardware, workload, dtype_bytes=dtype_bytes,
                                  kv_element_bytes=kv_format(name).element_bytes)
                    for name in ("float16", "int8")}
            base = runs["float16"].gpu_only.output_throughput
            rows.append({"hardware": setup.hardware, "model": setup.model, "input_len": setup.input_len,
                         "output_len": output_len, "paper_peak": setup.paper_peak,
                         **{f"{name}_{side}": getattr(run, side).output_throughput / base
                            for name, run in runs.items() for side in ("tandem", "gpu_only")},
                         **{f"{name}_gpu_blocks": run.setup.num_gpu_blocks for name, run in runs.items()}})
            print(format_kv_row(rows[-1]), flush=True)
    return rows


KV_HEADER = ("| machine | model | input | output | GPU-only int8 | tandem 16-bit | tandem int8 "
             "| GPU blocks 16-bit / int8 |\n|---|---|---:|---:|---:|---:|---:|---:|")


def format_kv_row(row: dict) -> str:
    """Throughputs relative to GPU-only with a 16-bit cache."""
    return (f"| {row['hardware']} | {row['model']} | {row['input_len']} | {row['output_len']} | "
            f"{row['int8_gpu_only']:.2f}x | {row['float16_tandem']:.2f}x | **{row['int8_tandem']:.2f}x** | "
            f"{row['float16_gpu_blocks']} / {row['int8_gpu_blocks']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and output lengths (smoke test)")
    args = parser.parse_args()
    num_requests = QUICK_NUM_REQUESTS if args.quick else NUM_REQUESTS
    output_lens = QUICK_OUTPUT_LENS if args.quick else OUTPUT_LENS

    start = time.perf_counter()
    print(HEADER)
    rows = [row for setup in SETUPS for row in run_setup(setup, output_lens, num_requests)]
    summary = summarize(rows)
    small_pool = t4_small_pool(num_requests)
    print(KV_HEADER)
    kv_rows = kv_format_rows(num_requests)
    lines = markdown(rows, summary, small_pool, num_requests)
    lines += ["", "With the KV cache in INT8 (`--kv-cache-dtype int8`), throughput relative to GPU-only with a "
              "16-bit cache, same GPU memory:", "", KV_HEADER, *map(format_kv_row, kv_rows)]
    print("\n" + "\n".join(lines))

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "setups": [asdict(s) for s in SETUPS],
        "num_requests": num_requests,
        "seed": SEED,
        "summary": summary,
        "t4_small_pool": small_pool,
        "kv_formats": kv_rows,
        "rows": rows,
    }, indent=2) + "\n")
    RESULTS.with_suffix(".md").write_text("\n".join(lines) + "\n")  # docs/benchmarks.md's block
    print(f"\nwrote {RESULTS} and .md in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
