"""PIPO's weight-streaming pipeline on the host-only testbed, side by side in one run.

A random-weight preset (default llama-3.2-1b in bf16: 16 layers of 116 MiB, embeddings 0.49 GiB)
with a weight budget that keeps every decoder layer off the GPU (`--weights-gpu-gib 1`:
embeddings, head, norms and the layer buffers only). One forward is the prefill of a P-token
prompt; P is chosen per tier where compute ~ transfer (the resident model's forward time closest
to the tier's transfer time, both measured here first). Engines, built once each, alternate
order each repetition (A B C D, D C B A):

  resident       every layer on the GPU: the forward's compute alone ("total compute")
  transfer only  the streamed engine's loads back to back with no compute ("total transfer")
  pipelined      PIPO's performance-optimised pipeline: the next layer loads while one computes
  serial         one buffer, each layer copied then computed (--cpu-offload-gb-style offload)
  beside         the resident forward while the streamed engine's transfer thread loads layers
                 back to back: what this VM leaves the compute while transfers run (its two vCPUs
                 share one physical core's resources)

for the host-memory tier (copies are memcpy by the transfer thread on the CPU-side core) and the
disk tier (O_DIRECT reads of per-layer files, then the copy). Reported: pipelined against serial
(target >= 1.8x), pipelined against max(total compute, total transfer) (target <= 1.15), and the
disk reader's rate (all layer files, as the transfer thread reads them) against fio's sequential
O_DIRECT rate on a file of the same disk (best of several queue depths), interleaved.

    nice -n 10 .venv/bin/python -m benchmarks.offload.weight_streaming [--reps 3] [--offload-dir DIR]
    python3 -m benchmarks.offload.weight_streaming --device cuda --tiers host ...   (pinned host memory to a GPU)
    python -m benchmarks.offload.weight_streaming --quick   (a small model, the host tier, one repetition)

Beside each tier's forwards, the transfer side's achieved rate (every streamed layer's bytes over
the "transfer only" time) is held against a bare copy of one layer's bytes in the same round: from
pinned host memory into a GPU buffer on cuda, a host memcpy on the testbed.

Writes benchmarks/results/weight_streaming.json and .md (its block in docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import kernels  # noqa: F401  (before torch: the engine's OpenMP spin cap)
import torch

from benchmarks.report import RESULTS_DIR, write_results
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.profiling.cache import host_cpu_model
from engine.weights.direct_io import DEFAULT_BLOCK_BYTES, DirectReader, aligned_empty, open_for_reading
from engine.weights.layer_files import write_file
from scheduler.sampling_params import SamplingParams

RESULTS = RESULTS_DIR / "weight_streaming.json"
# a GPU computes a prompt of thousands of tokens in the time a layer set crosses PCIe
PROMPT_GRID = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 256, 512, 1024, 2048, 4096, 8192, 16384)
FIO_SETTINGS = ("iodepth 1", "iodepth 4", "iodepth 16", "jobs 4")
FIO_REFERENCE_BYTES = 1 << 30


def engine_config(args, **weights) -> EngineConfig:
    return EngineConfig.from_flat(model=args.model, load_format="dummy", dtype=args.dtype, device=args.device,
                                  cpu_attention="off", max_model_len=args.max_model_len,
                                  kv_cache_memory_gib=args.kv_cache_gib, **weights)


def streamed(args, tier: str, pipeline: str) -> dict:
    placement = {"host": "cpu", "disk": "disk"}[tier]
    extra = {"offload_dir": str(args.offload_dir)} if tier == "disk" else {}
    return dict(weight_placement=placement, weights_gpu_gib=args.weights_gpu_gib, weight_pipeline=pipeline, **extra)


def forward_s(engine: LLMEngine, num_tokens: int, num_forwards: int) -> tuple[float, dict]:
    """Median forward time of `num_forwards` prefills of `num_tokens` (one request each), and the
    weight stream's transfer and stall seconds per forward."""
    times, transfer, stall = [], [], []
    vocab = engine.model_config.vocab_size
    for i in range(num_forwards):
        engine.add_request([(31 * i + 7 * j) % vocab for j in range(num_tokens)],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            times.append(engine.stats.forward_time)
            transfer.append(engine.stats.weight_transfer_time)
            stall.append(engine.stats.weight_stall_time)
    return statistics.median(times), {"transfer_s": statistics.median(transfer), "stall_s": statistics.median(stall)}


def transfer_only_s(engine: LLMEngine, num_cycles: int = 3) -> float:
    """Seconds the transfer thread spends loading every streamed layer once, with no compute:
    acquire and release each layer in order on the GPU's thread, cycles back to back."""
    model, store = engine.runner.model, engine.runner.model.layer_store

    def cycles():
        for _ in range(num_cycles):
            for layer in range(model.config.num_layers):
                store.acquire(layer)
                store.release(layer)
    cycles()  # warm-up: the loads in flight when it starts belong to no cycle
    before = engine.weight_stats.snapshot()
    engine.runner.gpu.submit(cycles).result()
    after = engine.weight_stats
    return (after.transfer_s - before.transfer_s) / (after.num_loads - before.num_loads) * len(store.ring.items)


def compute_beside_transfers_s(resident: LLMEngine, streaming: LLMEngine, num_tokens: int, num_forwards: int) -> float:
    """The resident forward while `streaming`'s transfer thread loads layers back to back (its
    GPU thread only acquires and releases, asleep between loads): what the VM's shared
    cores and memory bus leave the compute while transfers run, without the pipeline's ordering."""
    model, store = streaming.runner.model, streaming.runner.model.layer_store
    stop = threading.Event()

    def cycles():
        while not stop.is_set():
            for layer in range(model.config.num_layers):
                store.acquire(layer)
                store.release(layer)
    done = streaming.runner.gpu.submit(cycles)
    try:
        return forward_s(resident, num_tokens, num_forwards)[0]
    finally:
        stop.set()
        done.result()


def choose_prompt_len(resident: LLMEngine, transfer_s: float, compute_by_len: dict[int, float]) -> int:
    """The grid's prompt length whose resident forward takes closest to `transfer_s`."""
    for num_tokens in (n for n in PROMPT_GRID if n < resident.max_model_len):
        if num_tokens not in compute_by_len:
            compute_by_len[num_tokens] = forward_s(resident, num_tokens, 2)[0]
        if compute_by_len[num_tokens] >= transfer_s:
            break
    return min(compute_by_len, key=lambda n: abs(compute_by_len[n] - transfer_s))


def bare_copy_rate(num_bytes: int, device: str, num_copies: int = 5) -> float:
    """Bytes/s of a plain copy of `num_bytes` into the GPU's memory, the median of `num_copies`: from
    pinned host memory on cuda, host to host on the testbed (its GPU memory is host memory)."""
    on_cuda = device.startswith("cuda")
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=on_cuda).fill_(1)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device if on_cuda else "cpu")
    seconds = []
    for _ in range(num_copies):
        start = time.perf_counter()
        target.copy_(source, non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return num_bytes / statistics.median(seconds)


# ---- the disk ---------------------------------------------------------------------------------
def reader_rate(files: list[Path], num_threads: int) -> float:
    """Bytes/s reading every layer file in turn, as the transfer thread does (no copy after)."""
    reader = DirectReader(num_threads)
    buffer = aligned_empty(max(f.stat().st_size for f in files)).zero_()
    total, start = 0, time.perf_counter()
    try:
        for path in files:
            file = open_for_reading(path)
            if not file.direct:
                raise RuntimeError(f"{path}: {file.reason}; the benchmark needs a disk that takes O_DIRECT")
            size = path.stat().st_size
            reader.read(file, 0, size, buffer)
            total += size
            os.close(file.fd)
    finally:
        reader.close()
    return total / (time.perf_counter() - start)


def fio_rate(path: Path, setting: str) -> float:
    """fio's sequential O_DIRECT read rate of `path` in 8 MiB blocks: `setting` "iodepth N" (libaio,
    one job) or "jobs N" (N threads of synchronous reads, each a contiguous 1/N of the file, as
    the reader's threads take a layer's blocks)."""
    kind, count = setting.split()
    if kind == "iodepth":
        extra = ["--ioengine=libaio", f"--iodepth={count}"]
    else:
        part = path.stat().st_size // int(count)
        extra = ["--ioengine=psync", f"--numjobs={count}", f"--size={part}", f"--offset_increment={part}",
                 "--group_reporting"]
    out = subprocess.run(["fio", "--name=seq", f"--filename={path}", "--rw=read", "--direct=1",
                          f"--bs={DEFAULT_BLOCK_BYTES}", "--output-format=json", *extra],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"]


def dd_rate(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={DEFAULT_BLOCK_BYTES}", "iflag=direct"],
                   capture_output=True, check=True)
    return path.stat().st_size / (time.perf_counter() - start)


def disk_reference(directory: Path) -> Path:
    path = directory / "fio-reference.bin"
    if not path.exists() or path.stat().st_size != FIO_REFERENCE_BYTES:
        data = aligned_empty(FIO_REFERENCE_BYTES)
        data.copy_(torch.randint(0, 256, (FIO_REFERENCE_BYTES,), dtype=torch.uint8))
        write_file(path, data)
    return path


# ---- the run ------------------------------------------------------------------------------------
def measure_tier(args, tier: str, resident: LLMEngine, compute_by_len: dict[int, float]) -> dict:
    engines = {name: LLMEngine(engine_config(args, **streamed(args, tier, pipeline)))
               for name, pipeline in (("pipelined", "performance"), ("serial", "memory"))}
    try:
        placement = engines["pipelined"].plan.layers.placement
        transfer = transfer_only_s(engines["pipelined"])
        num_tokens = args.prompt_len.get(tier) or choose_prompt_len(resident, transfer, compute_by_len)
        print(f"{tier}: transfer {transfer:.3f} s a forward; prompt length {num_tokens}", file=sys.stderr, flush=True)
        names = ("resident", "resident beside transfers", "transfer only", "pipelined", "serial")
        samples: dict[str, list] = {name: [] for name in names}
        bare_copy: list[float] = []
        streams: dict[str, list] = {"pipelined": [], "serial": []}
        files = sorted(Path(args.offload_dir).glob("layer-*.bin")) if tier == "disk" else []
        reference = disk_reference(Path(args.offload_dir)) if tier == "disk" else None
        disk: dict[str, list] = {"reader": [], **{f"fio {setting}": [] for setting in FIO_SETTINGS}, "dd": []}
        for rep in range(args.reps):
            order = list(names)
            for name in order if rep % 2 == 0 else reversed(order):
                if name == "resident":
                    samples[name].append(forward_s(resident, num_tokens, args.forwards)[0])
                elif name == "resident beside transfers":
                    samples[name].append(compute_beside_transfers_s(resident, engines["pipelined"], num_tokens,
                                                                    args.forwards))
                elif name == "transfer only":
                    samples[name].append(transfer_only_s(engines["pipelined"]))
                    bare_copy.append(bare_copy_rate(placement.layer_bytes, args.device))
                else:
                    seconds, stream = forward_s(engines[name], num_tokens, args.forwards)
                    samples[name].append(seconds)
                    streams[name].append(stream)
            if tier == "disk" and shutil.which("fio"):
                for setting in FIO_SETTINGS:  # the disk's own rate and ours, alternating
                    disk[f"fio {setting}"].append(fio_rate(reference, setting))
                    disk["reader"].append(reader_rate(files, args.io_threads))
                disk["dd"].append(dd_rate(reference))
            print(tier, rep, {k: v[-1] for k, v in samples.items()}, file=sys.stderr, flush=True)
        medians = {name: statistics.median(values) for name, values in samples.items()}
        streamed_bytes = len(placement.streamed_layers) * placement.layer_bytes
        row = {"tier": tier, "prompt_len": num_tokens, "num_layers_streamed": len(placement.streamed_layers),
               "layer_mib": placement.layer_bytes / 2**20, **{f"{k}_s": v for k, v in medians.items()},
               "pipelined_stall_s": statistics.median(s["stall_s"] for s in streams["pipelined"]),
               "transfer_gbs": streamed_bytes / medians["transfer only"] / 1e9,
               "bare_copy_gbs": statistics.median(bare_copy) / 1e9,
               "speedup_vs_serial": medians["serial"] / medians["pipelined"],
               "vs_max_compute_transfer": medians["pipelined"] / max(medians["resident"], medians["transfer only"]),
               "vs_max_contended": medians["pipelined"] / max(medians["resident beside transfers"],
                                                              medians["transfer only"]),
               "samples": samples}
        if tier == "disk" and disk["reader"]:
            rates = {name: statistics.median(values) for name, values in disk.items() if values}
            best = max(v for k, v in rates.items() if k.startswith("fio"))
            row["disk"] = {"rates_gbs": {k: v / 1e9 for k, v in rates.items()}, "reader_vs_fio_best": rates["reader"] / best}
        return row
    finally:
        for engine in engines.values():
            engine.close()


def to_markdown(result: dict) -> str:
    where = result.get("device", "host-only testbed (GPU thread on one core, transfers on the other)")
    lines = [f"{result['cpu']}, {where}, "
             f"{result['model']} random weights in {result['dtype']}, every decoder layer streamed "
             f"(--weights-gpu-gib {result['weights_gpu_gib']}). One forward = the prefill of a P-token prompt, P "
             f"where compute ~ transfer; seconds per forward, medians of {result['forwards']} forwards and "
             f"{result['reps']} interleaved repetitions.", "",
             "| tier | P | layers streamed | resident (compute) | resident beside transfers | transfer only | "
             "pipelined (PIPO) | serial (copy, then compute) | pipelined stall | pipelined vs serial | "
             "pipelined / max(compute, transfer) | pipelined / max(compute beside transfers, transfer) | "
             "transfer GB/s | bare copy GB/s | transfer / bare copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['tier']} | {row['prompt_len']} | {row['num_layers_streamed']} x {row['layer_mib']:.0f} MiB | "
                     f"{row['resident_s']:.3f} | {row['resident beside transfers_s']:.3f} | "
                     f"{row['transfer only_s']:.3f} | {row['pipelined_s']:.3f} | "
                     f"{row['serial_s']:.3f} | {row['pipelined_stall_s']:.3f} | {row['speedup_vs_serial']:.2f}x | "
                     f"{row['vs_max_compute_transfer']:.2f} | {row['vs_max_contended']:.2f} | "
                     f"{row['transfer_gbs']:.2f} | {row['bare_copy_gbs']:.2f} | "
                     f"{row['transfer_gbs'] / row['bare_copy_gbs']:.0%} |")
    for row in result["rows"]:
        if "disk" in row:
            rates = row["disk"]["rates_gbs"]
            lines += ["", "Disk reads, GB/s (medians, interleaved): the transfer suite's O_DIRECT reader over every "
                      f"layer file ({result['io_threads']} threads, 8 MiB blocks) against the disk's own sequential "
                      "O_DIRECT rate on a 1 GiB file of the same filesystem:", "",
                      "| " + " | ".join(rates) + " | reader / best fio |", "|" + "---|" * (len(rates) + 1),
                      "| " + " | ".join(f"{v:.2f}" for v in rates.values()) + f" | {row['disk']['reader_vs_fio_best']:.2f} |"]
    return "\n".join(lines) + "\n"


# --quick's sizes: the embedded model's shape with most layers streamed, the host tier, a short prompt
QUICK = {"model": "smollm2-135m", "weights_gpu_gib": 0.1, "tiers": ["host"], "max_model_len": 64,
         "kv_cache_gib": 0.05, "reps": 1, "forwards": 1, "prompt_len_host": 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights-gpu-gib", type=float, default=1.0)
    parser.add_argument("--offload-dir", type=Path, default=Path.home() / ".cache" / "tandem" / "bench-offload")
    parser.add_argument("--tiers", nargs="+", default=["host", "disk"])
    parser.add_argument("--device", default="testbed", help="testbed, or cuda (with --tiers host: pinned host memory "
                                                             "to the GPU by its copy engine)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the longest prompt tried (cuda: 16385)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--forwards", type=int, default=3, help="forwards per measurement (median)")
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--prompt-len-host", type=int, default=None, help="default: where compute ~ transfer")
    parser.add_argument("--prompt-len-disk", type=int, default=None)
    parser.add_argument("--output", type=Path, default=None, help="default: results/weight_streaming.json, "
                                                                     "weight_streaming_gpu.json on cuda")
    parser.add_argument("--quick", action="store_true", help=f"small sizes: {QUICK}")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    on_cuda = args.device.startswith("cuda")
    args.output = args.output or (RESULTS.with_name("weight_streaming_gpu.json") if on_cuda else RESULTS)
    args.prompt_len = {"host": args.prompt_len_host, "disk": args.prompt_len_disk}
    # resident layers live in GPU buffers of their own under a placement, as streamed layers'
    # buffers do (same pages, same kernels): the compute the streamed forwards are compared with
    resident = LLMEngine(engine_config(args, weight_placement="gpu"))
    compute_by_len: dict[int, float] = {}
    try:
        rows = [measure_tier(args, tier, resident, compute_by_len) for tier in args.tiers]
    finally:
        resident.close()
    device = {"device": f"{torch.cuda.get_device_name()} (layers copied by its copy engine)"} if on_cuda else {}
    result = {"cpu": host_cpu_model(), **device, "model": args.model, "dtype": args.dtype,
              "weights_gpu_gib": args.weights_gpu_gib,
              "reps": args.reps, "forwards": args.forwards, "io_threads": args.io_threads,
              "compute_by_prompt_len_s": compute_by_len, "rows": rows}
    write_results(args.output, result, to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
