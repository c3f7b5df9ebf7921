"""CUDA graphs of the GPU-only decode step: one graph per batch bucket, replayed with one launch.

Eager, a decode step of a 32-layer model launches about 1700 kernels from Python, and the host
takes several times the GPU's time to issue them (docs/benchmarks.md, "Neo on a real GPU"). A
graph records the whole forward once per bucket of batch sizes and replays it. Its inputs live in
static device buffers, staged each step through one pinned host buffer per kind (no per-step
allocation or pageable copy):

- token ids, positions and context lengths, one int32 run of 3 x bucket;
- block tables [bucket, max_blocks] int32, only the columns the batch uses copied.

A batch short of its bucket is padded with copies of its last row: a padded row writes the very
K/V of the row it copies into the same slot and its logits are dropped, so no block of another
sequence is touched. Graphs are captured lazily, the first time a bucket is met, after one eager
warm-up forward (Triton's autotuning and lazily made buffers must not happen inside a capture).

Only the plain GPU-only decode of a model whose weights stay put is captured: prefills vary in
shape, Neo's pipelined plans hand work to the CPU mid-forward, streamed layers copy and wait on
events, tensor-parallel ranks all-reduce, and MoE routing reads expert counts on the host.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from engine.attention import AttentionMetadata

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8  # then every multiple of 8: a padded row costs a GEMM row, not a launch
MAX_CAPTURED_BATCH = 256


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: 1, 2, 4, then multiples of 8, the last the first
    to hold `max_batch` (capped at MAX_CAPTURED_BATCH)."""
    top = max(1, min(max_batch, MAX_CAPTURED_BATCH))
    sizes = (*SMALL_BUCKETS, *range(BUCKET_STEP, MAX_CAPTURED_BATCH + 1, BUCKET_STEP))
    last = bucket_for(top, sizes)
    return tuple(size for size in sizes if size < last) + (last,)


def bucket_for(num_rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_rows` rows; None past the largest."""
    return next((b for b in buckets if b >= num_rows), None)


@dataclass
class DecodeRows:
    """One decode batch as lists: each row's token, position and block table."""

    token_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.token_ids)

    def padded(self, size: int) -> "DecodeRows":
        """Rows to `size`, the last row repeated."""
        extra = size - len(self)
        return DecodeRows(self.token_ids + self.token_ids[-1:] * extra, self.positions + self.positions[-1:] * extra,
                          self.block_tables + self.block_tables[-1:] * extra)


class StaticDecodeInputs:
    """The device buffers a graph reads its batch from, and the host buffers they are staged
    through (pinned on CUDA): one int32 run of token ids, positions and context lengths (3 x
    bucket), and block tables [bucket, max_blocks] int32."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.device = device
        pinned = device.type == "cuda"
        self.rows = torch.zeros(3 * max_rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.rows_host = torch.zeros(3 * max_rows, dtype=torch.int32, pin_memory=pinned)
        self.tables_host = torch.zeros(max_rows, max_blocks, dtype=torch.int32, pin_memory=pinned)

    def stage(self, rows: DecodeRows) -> None:
        """`rows` into the device buffers: two host-to-device copies, of the columns in use."""
        size = len(rows)
        context_lens = [position + 1 for position in rows.positions]
        self.rows_host[:3 * size] = torch.tensor(rows.token_ids + rows.positions + context_lens, dtype=torch.int32)
        width = max(len(table) for table in rows.block_tables)
        padded = [table + [0] * (width - len(table)) for table in rows.block_tables]
        self.tables_host[:size, :width] = torch.tensor(padded, dtype=torch.int32)
        self.rows[:3 * size].copy_(self.rows_host[:3 * size], non_blocking=True)
        self.tables[:size, :width].copy_(self.tables_host[:size, :width], non_blocking=True)

    def forward_of(self, model, kv_cache, bucket: int):
        """The model's decode forward over the first `bucket` rows of the buffers -> logits [bucket, vocab]."""
        tokens, positions, context_lens = self.rows[:3 * bucket].view(3, bucket)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(prefill_seq_lens=[], num_prefill_tokens=0, slot_blocks=empty, slot_offsets=empty,
                                 decode_block_tables=self.tables[:bucket], decode_context_lens=context_lens)
        output_rows = torch.arange(bucket, device=self.device)
        return lambda: model.forward(tokens, positions, kv_cache, meta, output_rows)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # [bucket, vocab] fp32, the graph's output, rewritten by each replay
    # the captured forward: it holds the tensors made before the capture (metadata, output rows),
    # whose memory the graph reads at every replay and which must not be freed and reused
    forward: Callable[[], torch.Tensor]


class DecodeGraphs:
    """The captured decode steps of one model and KV cache (see the module's docstring)."""

    def __init__(self, model, kv_cache, max_batch: int, max_blocks_per_seq: int) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.device = model.device
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks_per_seq
        self.inputs = StaticDecodeInputs(self.buckets[-1], max_blocks_per_seq, self.device)
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.enabled = True
        self.num_replays = 0

    @classmethod
    def applies_to(cls, model) -> str | None:
        """Why `model` cannot run as graphs; None where it can."""
        if model.device.type != "cuda":
            return f"its device is {model.device.type}"
        if not getattr(model, "graph_capturable", False):
            return f"{type(model).__name__}'s forward reads values on the host"
        if not model.layer_store.graph_capturable:
            return f"its layers live in a {type(model.layer_store).__name__}, which moves or reduces them mid-forward"
        return None

    @property
    def captured_buckets(self) -> list[int]:
        return list(self._graphs)

    def takes(self, num_rows: int, max_blocks: int) -> bool:
        return self.enabled and bucket_for(num_rows, self.buckets) is not None and max_blocks <= self.max_blocks

    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        """The batch's logits [len(rows), vocab] fp32, from the bucket's graph (captured on first
        use), valid until the next run; None where the capture failed (graphs are then off and the
        caller runs the step eagerly)."""
        bucket = bucket_for(len(rows), self.buckets)
        self.inputs.stage(rows.padded(bucket))
        graph = self._graphs.get(bucket)
        if graph is None:
            try:
                graph = self._graphs[bucket] = self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 (any op the capture refuses: run eagerly from now on)
                logger.warning("CUDA graphs off: capturing the decode step for batch %d failed: %s", bucket, exc)
                self.enabled = False
                return None
        graph.graph.replay()
        self.num_replays += 1
        return graph.logits[:len(rows)]

    def _capture(self, bucket: int) -> _Graph:
        forward = self.inputs.forward_of(self.model, self.kv_cache, bucket)
        current = torch.cuda.current_stream(self.device)
        warmup = torch.cuda.Stream(self.device)
        warmup.wait_stream(current)
        with torch.cuda.stream(warmup):
            forward()  # writes the same K/V the replay writes again
        current.wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the server's, a copy thread) do not void the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward()
        logger.info("captured the decode step for batches up to %d as a CUDA graph", bucket)
        return _Graph(graph, logits, forward)
