"""CPU paged decode attention: kernel time, effective bandwidth, and speed-up over torch.

For each batch size and context length, in two attention shapes (Llama-3-8B's:
32 query heads sharing 8 kv heads of 128, GQA 4; and Llama-2-7B's: 32 heads
with a kv head each, MHA; bf16 KV in blocks of 16), this times the kernel and the
plain torch reference, and compares the kernel's effective bandwidth (KV bytes
read / time) with the machine's read bandwidth, measured by a large-tensor
torch.sum on the kernel's thread count in rounds interleaved with the kernel's
own, so a neighbour's load on a shared machine weighs on both alike. Each
round's timed calls follow SETTLE_SECONDS of untimed ones, so torch's OpenMP
threads, left spinning by the bandwidth sample, are not timed against the kernel.

In the same rounds a pure reader (benchmarks/kernels/pattern_reader.cpp, built here with
g++ on x86 with AVX2) streams the same caches in the kernel's access order with
no arithmetic: the share of the read bandwidth that the paged layout's access
order leaves, which the kernel cannot exceed. Also in the same rounds, the
kernel runs on 8 MiB of KV held in the last-level cache (InCacheRate): the rate
its cores reach at that moment when memory does not limit them.

Calls rotate over enough layers' caches that the KV touched between two visits
to one layer exceeds the last-level cache many times over, as in an engine
walking its layers, so the numbers are from DRAM, not cache. The caches are
allocated as the engine's host pool is (engine.kv.host_zeros: transparent
2 MiB pages where Linux grants them).

At GQA 4 every bf16 element read costs four fp32 fmas, at MHA one: the MHA
table shows the kernel's streaming with a quarter of the arithmetic per byte.

Each (batch, context) is timed with the bf16 caches, then with INT8 and INT4 pools
(kernels/kv_quant.py: group-quantized units, random codes, scales giving values in
[-1, 1]) of the same tokens, in consecutive rows of the same run; "x bf16" is a row's
kernel time over the bf16 row's (the issue's targets at contexts >= 1024: <= 0.6 for
INT8, <= 0.4 for INT4). A quantized row's bytes are its units' (codes and scales), and
its torch reference is not timed: it would attend dequantized fp32 copies.

    .venv/bin/python -m benchmarks.kernels.cpu_attention [--quick] [--shape gqa4|mha]
Prints a markdown table per shape and writes benchmarks/results/<shape's name>.json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import RESULTS_DIR
from engine.kv import host_zeros
from engine.profiling.profiler import median_seconds
from kernels import cpu, kv_quant
from kernels.cpu import reference
from kernels.cpu.build import BuildError, default_compiler, run_command

KV_DTYPE = torch.bfloat16
QUERY_DTYPE = torch.bfloat16
# Each row's KV formats: the 16-bit caches first, the quantized pools' rows beside them.
KV_FORMATS = ("bf16", "int8", "int4", "k8v4")
DENSE_FORMAT = "bf16"
# Largest fp32 copy of a quantized layer the error check dequantizes (the reference attends it).
MAX_DEQUANTIZED_BYTES = 512 << 20
BATCHES = [1, 8, 32, 128]
CONTEXTS = [256, 1024, 2048, 4096, 8192]
# Largest single-layer KV (K + V) a configuration may use; bigger ones are skipped.
MAX_KV_BYTES = 2 << 30
# KV touched between two calls on the same layer's cache, well past any LLC.
ROTATION_BYTES = 512 << 20
BANDWIDTH_TENSOR_BYTES = 2 << 30
KERNEL_REPS = 9
# Kernel calls, untimed, after each read-bandwidth sample: torch's OpenMP threads go on spinning
# for some milliseconds after torch.sum and take the kernel's cores (the first calls after it ran
# up to 20x slower on the 2-core VM, and the next ~10 up to 1.6x).
SETTLE_SECONDS = 0.05
# Rounds of (read-bandwidth sample, KERNEL_REPS kernel calls) per configuration.
ROUNDS = 3
REFERENCE_REPS = 3
PATTERN_READER_SOURCE = Path(__file__).resolve().parent / "pattern_reader.cpp"


def settle(fn, seconds: float) -> None:
    """Calls fn, untimed, for `seconds` (at least once)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < seconds:
        fn()


def wait_for_idle_pool() -> None:
    """Lets the kernel's pool workers, which poll for up to 1 ms after a call, go to sleep."""
    time.sleep(SETTLE_SECONDS)


class PatternReader:
    """benchmarks/kernels/pattern_reader.cpp, compiled into a temporary directory and loaded with ctypes."""

    def __init__(self, library: Path):
        self._library = ctypes.CDLL(str(library))
        self._library.read_pattern.restype = ctypes.c_double
        self._library.read_pattern.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]

    @classmethod
    def build(cls, directory: Path) -> "PatternReader | None":
        """None (with the reason printed) where it cannot be built: not x86 with AVX2, or no g++."""
        compiler = default_compiler()
        if "avx2" not in cpu.usable_isas() or shutil.which(compiler) is None:
            print(f"pattern reader skipped: needs x86 with AVX2 and {compiler}")
            return None
        library = directory / "pattern_reader.so"
        try:
            run_command([compiler, "-O2", "-std=c++17", "-mavx2", "-shared", "-fPIC", "-pthread",
                         str(PATTERN_READER_SOURCE), "-o", str(library)])
        except BuildError as exc:
            raise SystemExit(f"building the pattern reader failed:\n{exc}") from exc
        return cls(library)

    def read(self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
             num_threads: int, reps: int, first_layer: int = 0) -> tuple[float, float]:
        """(seconds per call, checksum) over reps + 1 calls, the first untimed; call i reads layer
        (first_layer + i) % num_layers of the caches (values [layers, blocks, kv_heads, block_size,
        head_dim] or quantized pools [layers, blocks, kv_heads, unit_bytes], keys the same size
        per (block, head), in any order within it).
        The checksum sums every fp32 word read (see pattern_reader.cpp)."""
        num_layers, num_blocks, num_kv_heads = value_cache.shape[:3]
        batch, blocks_per_seq = block_tables.shape
        head_bytes = value_cache[0, 0, 0].numel() * value_cache.element_size()
        if head_bytes % 64 or not (key_cache.is_contiguous() and value_cache.is_contiguous()
                                   and block_tables.is_contiguous() and block_tables.dtype == torch.int32):
            raise ValueError("the pattern reader needs contiguous caches with 64-byte (block, head) slices "
                             "and contiguous int32 block tables")
        checksum = ctypes.c_double()
        seconds = self._library.read_pattern(
            key_cache.data_ptr(), value_cache.data_ptr(), num_layers, first_layer, num_blocks,
            block_tables.data_ptr(), batch, blocks_per_seq, num_kv_heads, head_bytes, num_threads, reps,
            ctypes.byref(checksum))
        return seconds, checksum.value


class ReadBandwidth:
    """Bytes/s of torch.sum over a tensor far larger than the caches, on num_threads threads."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self.data = torch.ones(BANDWIDTH_TENSOR_BYTES // 4, dtype=torch.float32)

    def sample(self) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            return self.data.numel() * 4 / median_seconds(self.data.sum, warmup=1, repetitions=3)
        finally:
            torch.set_num_threads(previous)


@dataclasses.dataclass(frozen=True)
class Shape:
    """An attention shape; `name` is its results files' stem and docs/benchmarks.md block."""

    name: str
    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int = 128
    block_size: int = 16

    def kv_bytes(self, batch: int, context: int, kv_format: str = DENSE_FORMAT) -> int:
        """K and V bytes one call reads: bf16 elements, or a quantized pool's whole units."""
        if kv_format == DENSE_FORMAT:
            return 2 * batch * context * self.num_kv_heads * self.head_dim * KV_DTYPE.itemsize
        blocks = math.ceil(context / self.block_size)
        layout = self.layout(kv_format)
        return batch * blocks * self.num_kv_heads * (layout.key.unit_bytes + layout.value.unit_bytes)

    def layout(self, kv_format: str) -> kv_quant.FormatLayout:
        return kv_quant.layout_for(kv_format, self.head_dim, self.block_size)

    def describe(self) -> str:
        ratio = self.num_heads // self.num_kv_heads
        grouping = "MHA" if ratio == 1 else f"GQA {ratio}"
        return (f"{self.model} attention: {self.num_heads} query heads, {self.num_kv_heads} kv heads ({grouping}), "
                f"head_dim {self.head_dim}, bf16 KV in blocks of {self.block_size}")


SHAPES = {
    "gqa4": Shape("cpu_attention", "Llama-3-8B", num_heads=32, num_kv_heads=8),
    "mha": Shape("cpu_attention_mha", "Llama-2-7B", num_heads=32, num_kv_heads=32),
}


class Problem:
    """Random caches in `shape` of num_layers layers for `batch` sequences of `context` tokens each, blocks
    scattered at random: values [layers, blocks, kv_heads, block_size, head_dim], keys transposed
    within a block, [layers, blocks, kv_heads, head_dim, block_size]; or for a quantized kv_format
    pools [layers, blocks, kv_heads, unit_bytes]. By default on 2 MiB pages as the engine holds
    them; `allocate(size, dtype)` gives other memory."""

    def __init__(self, shape: Shape, batch: int, context: int, num_layers: int, allocate=host_zeros,
                 kv_format: str = DENSE_FORMAT):
        blocks_per_seq = math.ceil(context / shape.block_size)
        num_blocks = batch * blocks_per_seq
        blocks = (num_layers, num_blocks, shape.num_kv_heads)
        self.shape, self.kv_format = shape, kv_format
        if kv_format == DENSE_FORMAT:
            self.key_cache = allocate((*blocks, shape.head_dim, shape.block_size), KV_DTYPE).uniform_(-1, 1)
            self.value_cache = allocate((*blocks, shape.block_size, shape.head_dim), KV_DTYPE).uniform_(-1, 1)
        else:
            self.key_cache, self.value_cache = (random_pools(shape.layout(kv_format).side(is_key), blocks, allocate,
                                                             is_key) for is_key in (True, False))
        self.block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32)
        self.query = torch.randn(batch, shape.num_heads, shape.head_dim).to(QUERY_DTYPE)
        self.out = torch.empty_like(self.query)
        self.scale = 1 / math.sqrt(shape.head_dim)
        self.kv_bytes = shape.kv_bytes(batch, context, kv_format)
        quantized = kv_format != DENSE_FORMAT
        self.format_args = dict(kv_format=kv_format, block_size=shape.block_size) if quantized else {}

    def run_kernel(self, layer: int, num_threads: int, isa: str | None = None) -> None:
        cpu.paged_decode_attention(self.query, self.key_cache[layer], self.value_cache[layer], self.block_tables,
                                   self.context_lens, self.scale, out=self.out, num_threads=num_threads, isa=isa,
                                   **self.format_args)

    def run_reference(self) -> torch.Tensor | None:
        """The torch reference on layer 0 (over dequantized fp32 copies of quantized pools, None
        where those would exceed MAX_DEQUANTIZED_BYTES)."""
        key_cache, value_cache = self.key_cache[0], self.value_cache[0]
        if self.kv_format != DENSE_FORMAT:
            if 2 * key_cache.shape[0] * key_cache.shape[1] * self.shape.block_size * self.shape.head_dim * 4 \
                    > MAX_DEQUANTIZED_BYTES:
                return None
            layout = self.shape.layout(self.kv_format)
            key_cache = kv_quant.dequantize_pool(key_cache, layout.key, is_key=True)
            value_cache = kv_quant.dequantize_pool(value_cache, layout.value, is_key=False)
        return reference.paged_decode_attention(self.query, key_cache, value_cache, self.block_tables,
                                                self.context_lens, self.scale)


def random_pools(layout: kv_quant.QuantLayout, blocks: tuple, allocate, is_key: bool) -> torch.Tensor:
    """Pools [*blocks, unit_bytes] of random codes whose scales (and INT4 mins) map them onto
    [-1, 1], the bf16 caches' range."""
    pools = allocate((*blocks, layout.unit_bytes), torch.uint8).random_(0, 256)
    for layer in pools:
        views = kv_quant.unit_views(layer, layout, is_key)
        if layout.has_min:
            views.scales.fill_(2 / 15)
            views.mins.fill_(-1.0)
        else:
            views.scales.fill_(1 / 127)
    return pools


class InCacheRate:
    """Bytes/s of the kernel itself on 8 MiB of KV that stays in the last-level cache, called over
    and over: how fast its cores attend when memory is not what holds them back. A share of the
    read bandwidth above this rate cannot be reached at that moment: on the shared VM neighbours
    at times take half of a core's arithmetic (L1-resident work ran up to 1.5x slower within
    minutes), which a memory-bound reduction barely notices."""

    KV_BYTES = 8 << 20  # one sequence
    REPS = 15

    def __init__(self, shape: Shape, num_threads: int, kv_format: str = DENSE_FORMAT, isa: str | None = None):
        self.num_threads, self.isa = num_threads, isa
        context = self.KV_BYTES // shape.kv_bytes(1, shape.block_size, kv_format) * shape.block_size
        self.problem = Problem(shape, 1, context, 1, allocate=lambda size, dtype: torch.empty(size, dtype=dtype),
                               kv_format=kv_format)

    def sample(self) -> float:
        def run() -> None:
            self.problem.run_kernel(0, self.num_threads, self.isa)
        return self.problem.kv_bytes / median_seconds(run, warmup=2, repetitions=self.REPS)


def bench_config(shape: Shape, batch: int, context: int, num_threads: int, reference_reps: int,
                 bandwidth: ReadBandwidth, reader: PatternReader | None, in_cache: InCacheRate,
                 kv_format: str = DENSE_FORMAT, isa: str | None = None) -> dict:
    whole_blocks = math.ceil(context / shape.block_size) * shape.block_size
    num_layers = max(1, math.ceil(ROTATION_BYTES / shape.kv_bytes(batch, whole_blocks, kv_format)))
    problem = Problem(shape, batch, context, num_layers, kv_format=kv_format)
    layer = 0

    def run_kernel():
        nonlocal layer
        problem.run_kernel(layer, num_threads, isa)
        layer = (layer + 1) % num_layers

    for _ in range(num_layers):  # warm-up: one call per layer
        run_kernel()
    kernel_times, bandwidths, reader_times, in_cache_rates = [], [], [], []
    for _ in range(ROUNDS):
        bandwidths.append(bandwidth.sample())
        settle(run_kernel, SETTLE_SECONDS)
        kernel_times.append(median_seconds(run_kernel, warmup=0, repetitions=KERNEL_REPS))
        in_cache_rates.append(in_cache.sample())
        if reader is not None:
            wait_for_idle_pool()
            # From the layer the kernel would take next, the one it touched longest ago; the kernel
            # then goes on past the reader's layers, so neither reads what the other left in cache.
            reader_times.append(reader.read(problem.key_cache, problem.value_cache, problem.block_tables,
                                            num_threads, KERNEL_REPS, first_layer=layer)[0])
            layer = (layer + KERNEL_REPS + 1) % num_layers
    kernel_s = statistics.median(kernel_times)
    read_bps = statistics.median(bandwidths)
    reader_s = statistics.median(reader_times) if reader_times else None
    expected = problem.run_reference()
    problem.run_kernel(0, num_threads, isa)
    max_error = None if expected is None else (problem.out.float() - expected.float()).abs().max().item()
    reference_s = None
    if reference_reps and kv_format == DENSE_FORMAT:
        torch.set_num_threads(num_threads)
        wait_for_idle_pool()
        reference_s = median_seconds(problem.run_reference, warmup=0, repetitions=reference_reps)
    kv_bytes_read = problem.kv_bytes
    return {
        "kv_format": kv_format if isa is None else f"{kv_format} ({isa})",
        "batch": batch,
        "context": context,
        "kv_mib": kv_bytes_read / 2**20,
        "kernel_ms": kernel_s * 1e3,
        "kernel_gbps": kv_bytes_read / kernel_s / 1e9,
        "read_bandwidth_gbps": read_bps / 1e9,
        "in_cache_gbps": statistics.median(in_cache_rates) / 1e9,
        "percent_of_read_bandwidth": 100 * kv_bytes_read / kernel_s / read_bps,
        "pattern_reader_percent_of_read_bandwidth":
            None if reader_s is None else 100 * kv_bytes_read / reader_s / read_bps,
        "reference_ms": None if reference_s is None else reference_s * 1e3,
        "speedup": None if reference_s is None else reference_s / kernel_s,
        "max_abs_error_vs_reference": max_error,
        "layers_rotated": num_layers,
    }


def table_line(row: dict) -> str:
    """One results-table row; "-" where a quantized row has no reader or reference figures."""
    reader_percent = row["pattern_reader_percent_of_read_bandwidth"]
    reader_cells = ("- | -" if reader_percent is None else
                    f"{reader_percent:.0f}% | {row['percent_of_read_bandwidth'] / reader_percent:.2f}")
    reference_cells = ("- | -" if row["reference_ms"] is None else
                       f"{row['reference_ms']:.1f} | {row['speedup']:.1f}x")
    return (f"| {row['batch']} | {row['context']} | {row['kv_format']} | {row['kv_mib']:.0f} | "
            f"{row['kernel_ms']:.3f} | {row['time_vs_bf16']:.2f} | {row['kernel_gbps']:.1f} | "
            f"{row['read_bandwidth_gbps']:.1f} | {row['in_cache_gbps']:.1f} | {row['percent_of_read_bandwidth']:.0f}% | "
            f"{reader_cells} | {reference_cells} |")


def kernel_rows() -> list[tuple[str, str | None]]:
    """(KV format, isa) of each row of a (batch, context): every format on the best instruction set
    and, where that one attends quantized KV by integer dot products, each quantized format again
    on the best one that widens codes to fp32, so the two paths are timed side by side."""
    rows = [(kv_format, None) for kv_format in KV_FORMATS]
    dots = cpu.integer_dot_isas()
    fp32_isas = [isa for isa in cpu.usable_isas() if isa not in dots]
    if dots and dots[0] == cpu.usable_isas()[0] and fp32_isas:
        rows += [(kv_format, fp32_isas[0]) for kv_format in KV_FORMATS if kv_format != DENSE_FORMAT]
    return rows


def bench_shape(shape: Shape, batches: list[int], contexts: list[int], num_threads: int,
                bandwidth: ReadBandwidth, reader: PatternReader | None, results_name: str | None = None) -> None:
    """Runs the table of one shape and writes its results files (results_name: theirs, else the shape's)."""
    in_cache = {(kv_format, isa): InCacheRate(shape, num_threads, kv_format, isa) for kv_format, isa in kernel_rows()}
    title = (f"{shape.describe()}, and the same tokens in INT8, INT4 and K8V4 pools; isa {cpu.usable_isas()[0]}, {num_threads} kernel threads (cores available: "
             f"{len(os.sched_getaffinity(0))}); read BW: torch.sum over 2 GiB on {num_threads} threads, "
             f"median of {ROUNDS} samples interleaved with each row's kernel rounds; in-cache: the kernel on "
             f"8 MiB of KV held in the last-level cache, same rounds; pattern reader: the kernel's access "
             f"order with no arithmetic, same rounds")
    print(title + "\n")
    lines = [title, ""]
    rows = []
    header = ("| batch | context | KV | KV MiB | kernel ms | x bf16 | GB/s | read BW GB/s | in-cache GB/s "
              "| % of read BW | pattern reader % | kernel / reader | torch ref ms | speed-up |\n"
              "|---:|---:|:--|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(header)
    lines.append(header)
    for batch in batches:
        for context in contexts:
            call_bytes = shape.kv_bytes(batch, context)
            if call_bytes > MAX_KV_BYTES:
                continue
            dense_ms = None
            for kv_format, isa in kernel_rows():
                row = bench_config(shape, batch, context, num_threads,
                                   REFERENCE_REPS if call_bytes <= 256 << 20 else 1, bandwidth, reader,
                                   in_cache[kv_format, isa], kv_format, isa)
                dense_ms = dense_ms or row["kernel_ms"]
                row["time_vs_bf16"] = row["kernel_ms"] / dense_ms
                rows.append(row)
                lines.append(table_line(row))
                print(lines[-1], flush=True)

    results = RESULTS_DIR / f"{results_name or shape.name}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "machine": {"processor": platform.processor() or platform.machine(),
                    "cores": len(os.sched_getaffinity(0)), "isa": cpu.usable_isas()[0]},
        "shape": {**dataclasses.asdict(shape), "kv_dtype": str(KV_DTYPE), "query_dtype": str(QUERY_DTYPE),
                  "kv_formats": list(KV_FORMATS)},
        "kernel_threads": num_threads,
        "rows": rows,
    }, indent=2) + "\n")
    results.with_suffix(".md").write_text("\n".join(lines) + "\n")  # docs/benchmarks.md's table
    print(f"\nwrote {results.relative_to(Path.cwd()) if results.is_relative_to(Path.cwd()) else results}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configurations (smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: calibrated)")
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append",
                        help="attention shape (repeatable; default: all)")
    parser.add_argument("--results-name", help="results file name instead of the shape's (one --shape)")
    args = parser.parse_args()
    if not cpu.is_available():
        raise SystemExit(f"the CPU attention extension is not built; run `{cpu.BUILD_COMMAND}`")

    num_threads = args.threads or cpu.default_num_threads()
    batches, contexts = ([1, 32], [256, 2048]) if args.quick else (BATCHES, CONTEXTS)
    bandwidth = ReadBandwidth(num_threads)
    with tempfile.TemporaryDirectory() as build_dir:
        reader = PatternReader.build(Path(build_dir))
        for name in args.shape or list(SHAPES):
            bench_shape(SHAPES[name], batches, contexts, num_threads, bandwidth, reader, args.results_name)


if __name__ == "__main__":
    main()
