"""Measures this machine's cost tables for the offloading scheduler (Neo 3.2).

`profile_costs` times each quantity of `scheduler.planning.cost_model.CostModel` over a grid, in the
conditions the engine runs it:

- GPU work (linear stages, prefill and decode attention, the head, swaps) is submitted
  to the engine's own `GpuQueue` and timed from submit to result, so the queue's
  hand-off (a worker thread on the host-only testbed, an event wait on CUDA) is in the figure
  just as it is in every pipelined stage;
- the CPU-requests' decoding attention runs on the calling thread with the engine's CPU backend
  and thread count (the engine calls this inside `CoreAssignment.on_cpu_cores`).

Each point is the median of a few repetitions after a warm-up. Between and beyond the grid
points `TableCostModel` interpolates linearly.

The tables are cached per machine and model by engine/profiling/cache.py.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from engine.attention import DecodeAttentionBackend, prefill_attention
from engine.device.queues import GpuQueue
from engine.offload.stats import WeightStats
from engine.kv import KVCache, TwoTierKVCache
from engine.kv.layouts import resolve_kv_format
from engine.model_config import ModelConfig
from engine.model.llama import LlamaModel
from scheduler.planning.cost_model import Curve, Grid, TableCostModel, kv_bytes_per_token

# ---- the grid -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileGrid:
    """Where each table is measured. The defaults profile SmolLM2-135M in seconds on a 2-core
    host: few points, placed where the curves bend, and linear extrapolation past the last."""

    # One layer's linear work by token count: powers of two up to the scheduler's default
    # max_num_batched_tokens (2048). Small counts bend (fixed per-call overhead), large ones are
    # proportional to tokens, so the last segment extends well.
    linear_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    # Prefill attention of one sequence by prompt length; quadratic, so the points thicken at the
    # top where a chord would overestimate most.
    prefill_lens: tuple[int, ...] = (16, 64, 256, 512, 1024, 1536, 2048)
    # GPU decode attention by context tokens summed over the batch; memory-bound, so
    # close to linear in tokens.
    gpu_decode_context_tokens: tuple[int, ...] = (16, 128, 512, 2048, 8192, 32768)
    # The batch the GPU decode is timed on holds sequences of this many tokens: Neo's
    # workloads (prompts ~240, outputs up to 512) sit around it.
    decode_seq_len: int = 512
    # CPU decode attention, bilinear in (batch, context tokens summed over the batch): the batch
    # sets per-sequence overhead, the tokens set memory traffic.
    cpu_decode_batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    cpu_decode_context_tokens: tuple[int, ...] = (64, 1024, 8192, 32768)
    # Rows through the final norm and LM head per iteration: up to a few times max_num_seqs.
    head_rows: tuple[int, ...] = (1, 8, 64, 256)
    # Blocks in the timed swap copy: enough that per-copy overhead is amortised as in a real
    # swap of a few requests.
    swap_blocks: int = 32
    repetitions: int = 3  # timed runs per point; the median is kept
    warmup: int = 1  # untimed runs first: lazy initialisation, page faults, allocator growth
    # A forward streams every layer's weights and every request's KV from memory, so each timed
    # call works on data the calls before it did not touch: the linear table times all layers
    # back to back, the decode tables draw fresh blocks from a scratch pool of at least this many
    # bytes (8x the 32 MiB L3 of the development host). Timed on warm caches, the testbed's
    # linear and CPU attention ran 25-60% faster than inside the engine's forward.
    cold_bytes: int = 256 * 2**20
    # Round trips through the GPU queue timed for the pipeline's hand-off cost (tiny
    # and noisy, hence many).
    handoff_repetitions: int = 50

    def __post_init__(self) -> None:
        axes = ("linear_tokens", "prefill_lens", "gpu_decode_context_tokens", "cpu_decode_batch_sizes",
                "cpu_decode_context_tokens", "head_rows")
        for name in axes:
            axis = getattr(self, name)
            if not axis or any(not isinstance(x, int) or x < 1 for x in axis):
                raise ValueError(f"ProfileGrid.{name} must be a non-empty tuple of positive ints, got {axis!r}")
            if any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"ProfileGrid.{name} must be strictly increasing, got {axis!r}")
        for name in ("decode_seq_len", "swap_blocks", "repetitions", "cold_bytes", "handoff_repetitions"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProfileGrid.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"ProfileGrid.warmup must be >= 0, got {self.warmup}")
        if self.cpu_decode_context_tokens[0] < self.cpu_decode_batch_sizes[-1]:
            raise ValueError(
                f"every CPU decode grid cell needs >= 1 token per sequence: the smallest context "
                f"({self.cpu_decode_context_tokens[0]}) is below the largest batch ({self.cpu_decode_batch_sizes[-1]})")

    @classmethod
    def quick(cls) -> "ProfileGrid":
        """A coarse grid for tests: two or three points per table, one timed run each."""
        return cls(linear_tokens=(1, 8, 32), prefill_lens=(8, 32), gpu_decode_context_tokens=(16, 64),
                   decode_seq_len=16, cpu_decode_batch_sizes=(1, 4), cpu_decode_context_tokens=(16, 64),
                   head_rows=(1, 4), swap_blocks=4, repetitions=1, warmup=1, cold_bytes=2**20,
                   handoff_repetitions=5)

    @property
    def num_points(self) -> int:
        """Measurements in one profile (the progress bar's length); swap and hand-off count one each."""
        return (len(self.linear_tokens) + len(self.prefill_lens) + len(self.gpu_decode_context_tokens)
                + len(self.cpu_decode_batch_sizes) * len(self.cpu_decode_context_tokens) + len(self.head_rows) + 2)


# ---- measuring ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _BlockMove:
    """One swap's blocks (satisfies engine.kv.BlockMove)."""

    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


def median_seconds(run: Callable[[], Any], warmup: int, repetitions: int) -> float:
    """The median wall time of `repetitions` runs after `warmup` unmeasured ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _split_evenly(total: int, parts: int) -> list[int]:
    """`total` tokens over `parts` sequences, lengths differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


class _Profiler:
    def __init__(self, model: LlamaModel, gpu: GpuQueue, gpu_decode: DecodeAttentionBackend,
                 cpu_decode: DecodeAttentionBackend, block_size: int, dtype: torch.dtype, grid: ProfileGrid,
                 bar: tqdm, weight_stats: WeightStats | None = None, kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.kv_cache_dtype = kv_cache_dtype
        self.weight_stats = weight_stats
        self.config: ModelConfig = model.config
        self.gpu = gpu
        self.device = gpu.device
        self.gpu_decode = gpu_decode
        self.cpu_decode = cpu_decode
        self.block_size = block_size
        self.dtype = dtype
        self.grid = grid
        self.bar = bar
        self.scale = self.config.head_dim ** -0.5
        # Block ids are handed out in a shuffled order, as a pool's free list is after some traffic.
        self.generator = torch.Generator().manual_seed(0)

    # ---- helpers ----------------------------------------------------------------------------
    def on_gpu(self, work: Callable[[], Any]) -> float:
        return median_seconds(lambda: self.gpu.submit(work).result(), self.grid.warmup, self.grid.repetitions)

    def here(self, work: Callable[[], Any]) -> float:
        return median_seconds(work, self.grid.warmup, self.grid.repetitions)

    def point(self, table: str, x: Any, seconds: float) -> float:
        self.bar.set_postfix_str(f"{table} {x}", refresh=False)
        self.bar.update(1)
        return seconds

    def random(self, *shape: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=device or self.device)

    def scratch_cache(self, num_blocks: int, device: torch.device) -> KVCache:
        """One layer's paged K/V, filled: fresh zeroed host memory is backed by the shared zero page
        until written, and reading it would flatter memory-bound kernels."""
        cache = KVCache(dataclasses.replace(self.config, num_layers=1), num_blocks, self.block_size, self.dtype, device,
                        kv_cache_dtype=self.kv_cache_dtype)
        cache.fill_random()
        return cache

    def block_tables(self, seq_lens: Sequence[int], num_blocks: int, device: torch.device):
        """-> block tables [num_seqs, max_blocks] int32, context lengths [num_seqs] int32."""
        order = torch.randperm(num_blocks, generator=self.generator).tolist()
        tables, used = [], 0
        for length in seq_lens:
            count = -(-length // self.block_size)
            tables.append(order[used:used + count])
            used += count
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]  # past the context: masked
        return (torch.tensor(padded, dtype=torch.int32, device=device),
                torch.tensor(list(seq_lens), dtype=torch.int32, device=device))

    def decode_seconds(self, backend: DecodeAttentionBackend, cache: KVCache, seq_lens: Sequence[int],
                       run: Callable[[Callable[[], Any]], float]) -> float:
        """Each call reads blocks freshly drawn from `cache` (see ProfileGrid.cold_bytes)."""
        device = cache.key.device
        layouts = [self.block_tables(seq_lens, cache.num_blocks, device)
                   for _ in range(self.grid.warmup + self.grid.repetitions)]
        batch, cfg = len(seq_lens), self.config
        query = self.random(batch, cfg.num_heads, cfg.head_dim, device=device)
        new_key = self.random(batch, cfg.num_kv_heads, cfg.head_dim, device=device)
        new_value = self.random(batch, cfg.num_kv_heads, cfg.head_dim, device=device)

        def work():
            tables, context_lens = layouts.pop()
            backend.forward(query, cache.key[0], cache.value[0], tables, context_lens, self.scale, new_key, new_value)
        return run(work)

    def cold_pool_blocks(self, largest: int) -> int:
        """Blocks of a scratch pool to draw `largest`-block working sets from, cold."""
        cfg = self.config
        # one layer, as the scratch pools hold
        fmt = resolve_kv_format(self.kv_cache_dtype, self.dtype)
        block_bytes = self.block_size * kv_bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, fmt.element_bytes)
        return max(2 * largest, -(-self.grid.cold_bytes // block_bytes))

    def blocks_for(self, seq_lens: Sequence[int]) -> int:
        return sum(-(-n // self.block_size) for n in seq_lens)

    # ---- tables -----------------------------------------------------------------------------
    def linear(self) -> Curve:
        cfg, model = self.config, self.model
        points = []
        for num_tokens in self.grid.linear_tokens:
            hidden = self.random(num_tokens, cfg.hidden_size)
            attn_out = self.random(num_tokens, cfg.q_size)
            # RoPE's cost does not depend on the positions' values, and position 0 exists for any model.
            positions = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)

            def work():  # every layer back to back, as the forward streams them
                for layer in range(cfg.num_layers):
                    model.layer_store.acquire(layer)
                    model.pre_proj(layer, hidden, positions)
                    model.post_proj(layer, hidden, attn_out)
                    model.layer_store.release(layer)
            seconds = self.compute_seconds(work) / cfg.num_layers
            points.append((num_tokens, self.point("linear", num_tokens, seconds)))
        return Curve.from_points(points)

    def compute_seconds(self, work: Callable[[], Any]) -> float:
        """`work` on the GPU, less what it waited for streamed layers' weights: the
        compute the table is of (the transfers are the cost model's own term)."""
        def stalled() -> float:
            return 0.0 if self.weight_stats is None else self.weight_stats.stall_s

        def run() -> float:
            before = stalled()
            start = time.perf_counter()
            self.gpu.submit(work).result()
            return time.perf_counter() - start - (stalled() - before)
        for _ in range(self.grid.warmup):
            run()
        return statistics.median(run() for _ in range(self.grid.repetitions))

    def prefill(self) -> Curve:
        cfg = self.config
        cache = self.scratch_cache(self.blocks_for([self.grid.prefill_lens[-1]]), self.device)
        points = []
        for length in self.grid.prefill_lens:
            q = self.random(length, cfg.num_heads, cfg.head_dim)
            k = self.random(length, cfg.num_kv_heads, cfg.head_dim)
            v = self.random(length, cfg.num_kv_heads, cfg.head_dim)
            token = torch.arange(length, device=self.device)
            slot_blocks, slot_offsets = token // self.block_size, token % self.block_size

            def work():
                # as the model's attention stage does for a prefill: store its K/V, then attend
                cache.write(0, k, v, slot_blocks, slot_offsets)
                prefill_attention(q, k, v, [length], self.scale)
            points.append((length, self.point("prefill attention", length, self.on_gpu(work))))
        return Curve.from_points(points)

    def gpu_decode_curve(self) -> Curve:
        layouts = [_split_evenly(total, -(-total // self.grid.decode_seq_len))
                   for total in self.grid.gpu_decode_context_tokens]
        cache = self.scratch_cache(self.cold_pool_blocks(max(self.blocks_for(lens) for lens in layouts)), self.device)
        points = []
        for total, seq_lens in zip(self.grid.gpu_decode_context_tokens, layouts):
            seconds = self.decode_seconds(self.gpu_decode, cache, seq_lens, self.on_gpu)
            points.append((total, self.point("GPU decode attention", total, seconds)))
        return Curve.from_points(points)

    def cpu_decode_grid(self) -> Grid:
        batches, totals = self.grid.cpu_decode_batch_sizes, self.grid.cpu_decode_context_tokens
        host = torch.device("cpu")
        largest = max(self.blocks_for(_split_evenly(t, b)) for b in batches for t in totals)
        cache = self.scratch_cache(self.cold_pool_blocks(largest), host)
        rows = []
        for batch in batches:
            row = []
            for total in totals:
                seconds = self.decode_seconds(self.cpu_decode, cache, _split_evenly(total, batch), self.here)
                row.append(self.point("CPU decode attention", (batch, total), seconds))
            rows.append(tuple(row))
        return Grid(tuple(map(float, batches)), tuple(map(float, totals)), tuple(rows))

    def head(self) -> Curve:
        model, points = self.model, []
        for num_rows in self.grid.head_rows:
            token_ids = torch.randint(0, self.config.vocab_size, (num_rows,), device=self.device)
            last_indices = torch.arange(num_rows, device=self.device)

            def work():
                model.post_layer(model.pre_layer(token_ids), last_indices)
            points.append((num_rows, self.point("head", num_rows, self.on_gpu(work))))
        return Curve.from_points(points)

    def handoff(self) -> float:
        """One round trip through the GPU queue: a CPU attention stage waits for its
        inputs and the GPU for its output (testbed: two thread wake-ups)."""
        seconds = median_seconds(lambda: self.gpu.submit(lambda: None).result(), self.grid.warmup,
                                  self.grid.handoff_repetitions)
        return self.point("hand-off", self.grid.handoff_repetitions, seconds)

    def swap_per_block(self) -> float:
        """Seconds per block of one swap-out and one swap-in, averaged, through the engine's copy path."""
        num_blocks = self.grid.swap_blocks
        gpu_pool = KVCache(self.config, num_blocks, self.block_size, self.dtype, self.device,
                           kv_cache_dtype=self.kv_cache_dtype)
        host_pool = KVCache(self.config, num_blocks, self.block_size, self.dtype, "cpu",
                            pin_memory=self.device.type == "cuda", kv_cache_dtype=self.kv_cache_dtype)
        for cache in (gpu_pool, host_pool):  # touch every page (see scratch_cache)
            cache.fill_random()
        pools = TwoTierKVCache(gpu_pool, host_pool)
        moves = [_BlockMove(tuple(range(num_blocks)), tuple(range(num_blocks)))]
        seconds = [
            median_seconds(lambda: self.gpu.submit_copy(lambda: pools.copy_blocks(moves, to_cpu)).result(),
                            self.grid.warmup, self.grid.repetitions)
            for to_cpu in (True, False)
        ]
        return self.point("swap", num_blocks, statistics.fmean(seconds) / num_blocks)


@torch.inference_mode()
def profile_costs(model: LlamaModel, gpu: GpuQueue, gpu_decode: DecodeAttentionBackend,
                  cpu_decode: DecodeAttentionBackend, *, block_size: int, dtype: torch.dtype,
                  grid: ProfileGrid | None = None, progress: bool = False,
                  weight_stats: WeightStats | None = None, kv_cache_dtype: str = "auto") -> TableCostModel:
    """Measure every table of `TableCostModel` for `model` on this machine.

    `gpu_decode` is the GPU's decode backend (run on `gpu`), `cpu_decode` the
    CPU-requests' backend (run on the calling thread, which should hold the CPU attention's
    cores and thread count); `weight_stats`, the sink the model's layer store writes to, says
    how long forwards waited for streamed weights. Scratch KV pools are allocated here and freed
    on return."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    grid = grid or ProfileGrid()
    with tqdm(total=grid.num_points, desc="profiling costs", unit="point", disable=not progress) as bar:
        profiler = _Profiler(model, gpu, gpu_decode, cpu_decode, block_size, dtype, grid, bar, weight_stats,
                             kv_cache_dtype)
        try:
            return TableCostModel(
                num_layers=model.config.num_layers,
                linear_curve=profiler.linear(),
                prefill_curve=profiler.prefill(),
                gpu_decode_curve=profiler.gpu_decode_curve(),
                cpu_decode_grid=profiler.cpu_decode_grid(),
                head_curve=profiler.head(),
                swap_per_block=profiler.swap_per_block(),
                handoff_seconds=profiler.handoff(),
            )
        except BaseException:
            gpu.recover()  # a failed closure must not poison the engine's queue
            raise
