"""The model runner: owns every tensor (weights, both KV pools) and executes an IterationPlan.

A plan's swaps are copied first (queued before the forward, adjacent blocks merged). A GPU-only
plan runs the plain layer-by-layer forward on the accelerator; a pipelined plan runs Neo's
asymmetric two-batch forward (engine/pipeline.py) with the CPU-requests' decoding attention on
the calling thread.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, CpuDecodeMetadata, create_decode_backend
from engine.config import ModelConfig
from engine.kv_cache import KVCache, TwoTierKVCache
from engine.model import LlamaModel
from engine.pipeline import BatchInputs, PipelineTimes, pipelined_forward
from engine.sampler import Sampler, SamplerOutput
from engine.streams import AcceleratorQueue, CudaStreamQueue, InlineQueue, WorkerThreadQueue
from engine.weights import WeightLoader
from scheduler.request import Tier
from scheduler.scheduler import IterationPlan, PlanMode, ScheduledSeq

# `device` values: where the "accelerator" is.
DEVICES = ("cpu", "testbed", "cuda")


@dataclass(frozen=True)
class Placement:
    """Which cores do what on the host-only testbed (and how many threads the CPU attention uses
    anywhere). `cpu` and `cuda`: the accelerator needs no cores of its own."""

    device: str
    accelerator_cores: frozenset[int] = frozenset()
    cpu_attention_cores: frozenset[int] = frozenset()
    cpu_attention_threads: int = 1

    @classmethod
    def for_device(cls, device: str, accelerator_threads: int | None = None,
                   cpu_attention_threads: int | None = None) -> "Placement":
        kind = torch.device(device).type if device != "testbed" else "testbed"
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if kind == "cuda":  # the host's cores are all the CPU attention's while the GPU computes
            return cls(kind, cpu_attention_cores=frozenset(cores), cpu_attention_threads=cpu_attention_threads or len(cores))
        if kind != "testbed":
            # serial on one CPU: torch's pool owns the cores between ops (CpuPagedDecode.IN_ENGINE_THREADS)
            return cls(kind, cpu_attention_threads=cpu_attention_threads or 1)
        if len(cores) < 2:
            raise ValueError("the host-only testbed needs at least 2 cores: one for the accelerator thread, "
                             "one for the CPU attention")
        # Default split: half the cores play the accelerator, the rest run the CPU attention.
        num_accelerator = accelerator_threads or max(1, len(cores) // 2)
        if num_accelerator >= len(cores):
            raise ValueError(f"accelerator_threads ({num_accelerator}) leaves no core for the CPU attention "
                             f"({len(cores)} cores)")
        rest = cores[num_accelerator:]
        return cls("testbed", frozenset(cores[:num_accelerator]), frozenset(rest),
                   cpu_attention_threads or len(rest))

    @property
    def accelerator_threads(self) -> int:
        return len(self.accelerator_cores) or 1


@dataclass
class RunnerOutput:
    """One sampled token per scheduled sequence, in plan order (batch-0, then batch-1)."""

    sampled: SamplerOutput
    forward_time: float = 0.0  # seconds from the first queued work to the logits
    pipeline: PipelineTimes | None = None  # pipelined plans only
    num_swap_copies: int = 0

    @property
    def sampled_token_ids(self) -> list[int]:
        return self.sampled.token_ids


@dataclass
class _Rows:
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    last_indices: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: ModelConfig, loader: WeightLoader, *, dtype: torch.dtype,
                 device: str, num_blocks: int, block_size: int, max_model_len: int,
                 num_cpu_blocks: int = 0, placement: Placement | None = None,
                 decode_backend: str = "auto", seed: int | None = None, show_progress: bool = False) -> None:
        self.config = config
        self.placement = placement or Placement.for_device(device)
        self.accelerator = self._make_accelerator(device)
        self.device = self.accelerator.device
        self.block_size = block_size
        self.model = LlamaModel(config, loader, dtype, self.device, max_model_len,
                                create_decode_backend(decode_backend, str(self.device)), show_progress=show_progress)
        cpu_pool = None
        if num_cpu_blocks:
            cpu_pool = KVCache(config, num_cpu_blocks, block_size, dtype, "cpu",
                               pin_memory=self.device.type == "cuda")
        self.kv_cache = TwoTierKVCache(KVCache(config, num_blocks, block_size, dtype, self.device), cpu_pool)
        # The CPU-requests' attention: the C++ kernel with the CPU's share of threads.
        self.cpu_decode = None
        if num_cpu_blocks:
            self.cpu_decode = create_decode_backend(decode_backend, "cpu")
            if hasattr(self.cpu_decode, "num_threads"):
                self.cpu_decode.num_threads = self.placement.cpu_attention_threads
        self.sampler = Sampler(config.vocab_size, seed=seed)

    def _make_accelerator(self, device: str) -> AcceleratorQueue:
        if self.placement.device == "testbed":
            return WorkerThreadQueue(set(self.placement.accelerator_cores), self.placement.accelerator_threads)
        if self.placement.device == "cuda":
            return CudaStreamQueue(device)
        return InlineQueue(device)

    def close(self) -> None:
        self.accelerator.close()

    @contextmanager
    def on_cpu_cores(self):
        """Testbed: the thread that conducts the pipeline computes the CPU attention, so for the
        forward it keeps to the CPU's cores and thread count and leaves the accelerator's alone;
        the caller's own settings come back afterwards."""
        if self.placement.device != "testbed" or not hasattr(os, "sched_setaffinity"):
            yield
            return
        cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, set(self.placement.cpu_attention_cores))
        torch.set_num_threads(self.placement.cpu_attention_threads)
        try:
            yield
        finally:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)

    # ---- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: IterationPlan) -> RunnerOutput:
        start = time.perf_counter()
        logits, times, num_copies = self._forward(plan)
        forward_time = time.perf_counter() - start
        sampled = self.sampler(logits, [s.request for s in plan.scheduled])
        return RunnerOutput(sampled, forward_time, times, num_copies)

    @torch.inference_mode()
    def compute_logits(self, plan: IterationPlan) -> torch.Tensor:
        """Run the model over the plan. -> [num_scheduled, vocab] fp32, rows in `plan.scheduled` order"""
        return self._forward(plan)[0]

    def _forward(self, plan: IterationPlan) -> tuple[torch.Tensor, PipelineTimes | None, int]:
        with self.on_cpu_cores():
            return self._forward_placed(plan)

    def _forward_placed(self, plan: IterationPlan) -> tuple[torch.Tensor, PipelineTimes | None, int]:
        try:
            num_copies = self._swap(plan)
            if plan.mode == PlanMode.GPU_ONLY and not (plan.cpu_decodes or plan.cpu_decodes1):
                batch = self._build_batch(plan.prefills, plan.decodes, [])
                logits = self.accelerator.submit(lambda: self.model.forward(
                    batch.token_ids, batch.positions, self.kv_cache, batch.meta, batch.last_indices)).result()
                return logits, None, num_copies
            if self.cpu_decode is None:
                raise RuntimeError("a pipelined plan needs the host KV pool, but offloading is off")
            times = PipelineTimes()
            batch0 = self._build_batch(plan.prefills, plan.decodes, plan.cpu_decodes)
            batch1 = self._build_batch([], [], plan.cpu_decodes1)
            logits = pipelined_forward(self.model, self.accelerator, self.kv_cache, self.cpu_decode,
                                       batch0, batch1, times)
            return logits, times, num_copies
        except BaseException:
            self.accelerator.recover()
            raise

    def _swap(self, plan: IterationPlan) -> int:
        if not (plan.swap_out or plan.swap_in):
            return 0
        if plan.swap_out and plan.swap_in:
            # a swap-in may reuse GPU blocks a swap-out still has to read, and the other way round
            raise RuntimeError("a plan must not swap out and swap in in the same iteration")
        kv, to_cpu = self.kv_cache, bool(plan.swap_out)
        moves = plan.swap_out or plan.swap_in
        return self.accelerator.submit_copy(lambda: kv.copy_blocks(moves, to_cpu=to_cpu)).result()

    def _build_batch(self, prefills: list[ScheduledSeq], gpu_decodes: list[ScheduledSeq],
                     cpu_decodes: list[ScheduledSeq]) -> BatchInputs:
        """Pack one sub-batch: prefill tokens, then GPU decodes, then CPU decodes."""
        rows = _Rows()
        for seq in (*prefills, *gpu_decodes, *cpu_decodes):
            start, count = seq.num_computed_tokens, seq.num_new_tokens
            rows.token_ids.extend(seq.token_ids)
            rows.positions.extend(range(start, start + count))
            rows.last_indices.append(len(rows.token_ids) - 1)

        block_size, device = self.block_size, self.device
        slots, slot_rows, cpu_prefills, prefill_seq_lens = [], [], [], []
        row = 0
        for seq in prefills:
            table, start, count = seq.request.block_ids, seq.num_computed_tokens, seq.num_new_tokens
            prefill_seq_lens.append(count)
            if seq.request.tier is Tier.CPU:
                if start != 0:
                    raise RuntimeError(f"request {seq.request.request_id}: a prefill bound for the host pool "
                                       f"must start at position 0, not {start}")
                cpu_prefills.append((row, count, tuple(table)))
            else:
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + count))
                slot_rows.extend(range(row, row + count))
            row += count
        slot_tensor = torch.tensor(slots, dtype=torch.int64)
        block_tables, context_lens = _decode_tables(gpu_decodes, device)
        meta = AttentionMetadata(
            prefill_seq_lens=prefill_seq_lens,
            num_prefill_tokens=row,
            slot_blocks=(slot_tensor // block_size).to(device),
            slot_offsets=(slot_tensor % block_size).to(device),
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            cpu_prefills=tuple(cpu_prefills),
            slot_rows=torch.tensor(slot_rows, dtype=torch.int64, device=device) if cpu_prefills else None,
        )
        cpu_meta = None
        if cpu_decodes:
            cpu_meta = CpuDecodeMetadata(*_decode_tables(cpu_decodes, torch.device("cpu")))
        return BatchInputs(
            token_ids=torch.tensor(rows.token_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(rows.positions, dtype=torch.int64, device=device),
            meta=meta, cpu=cpu_meta,
            last_indices=torch.tensor(rows.last_indices, dtype=torch.int64, device=device),
        )


def _decode_tables(decodes: list[ScheduledSeq], device: torch.device):
    """-> block tables [num_decodes, max_blocks] int32 (unused entries point at block 0 and are
    masked by the context lengths) and context lengths [num_decodes] int32; (None, None) if empty."""
    if not decodes:
        return None, None
    max_blocks = max(len(s.request.block_ids) for s in decodes)
    tables = torch.tensor([s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in decodes],
                          dtype=torch.int32, device=device)
    context_lens = torch.tensor([s.num_computed_tokens + 1 for s in decodes], dtype=torch.int32, device=device)
    return tables, context_lens
