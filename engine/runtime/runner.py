"""The model runner: owns every tensor (weights, both KV pools) and executes an IterationPlan.

A plan's swaps are copied first (queued before the forward, adjacent blocks merged). A GPU-only
plan runs the plain layer-by-layer forward on the GPU; a pipelined plan runs Neo's
asymmetric two-batch forward (engine/runtime/pipeline.py) with the CPU-requests' decoding attention on
the calling thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.attention import create_decode_backend
from engine.config import CpuOps, Int4Prefill
from engine.kv.layouts import create_layout
from engine.runtime.batch import build_batch, prompt_logprob_positions
from engine.device.cores import CoreAssignment
from engine.runtime.cuda_graphs import DecodeGraphs, DecodeRows
from engine.runtime.pipeline import PipelineTimes, pipelined_forward
from engine.device.queues import GpuQueue, CudaStreamQueue, InlineQueue, WorkerThreadQueue
from engine.kv import KVCache, TwoTierKVCache
from engine.model_config import ModelConfig
from engine.model.layer_store import LayerStore
from engine.model.registry import create_model
from engine.outputs import TokenLogprob
from engine.quant import LinearMethod, create_linear_method
from engine.sampling import Sampler, SamplerOutput, prompt_logprobs
from engine.weights import WeightLoader
from scheduler.iteration_plan import IterationPlan, PlanMode

logger = logging.getLogger(__name__)


class FatalRunnerError(RuntimeError):
    """The runner cannot run another step (a tensor-parallel rank died): the engine stops, where a
    failed forward only fails the requests in flight."""


@dataclass
class RunnerOutput:
    """One sampled token per sampling share of the plan (`plan.sampling`), in plan order."""

    sampled: SamplerOutput
    forward_time: float = 0.0  # seconds from the first queued work to the logits
    pipeline: PipelineTimes | None = None  # pipelined plans only
    # row of plan.scheduled -> the prompt logprobs entries its chunk gave, for prefills that asked for them
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # per verify share of the plan (`plan.verifies`, in order): its rows' logits [1 + drafts, vocab]
    verify_logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ForwardLogits:
    """A forward's logits: each scheduled sequence's rows (one; a verify share's every row), then
    the prompt rows."""

    rows: torch.Tensor  # [num_sequence_rows + num_prompt_rows, vocab] fp32
    prompt_spans: list[tuple[int, int]]  # (row of plan.scheduled, number of prompt rows), in order
    pipeline: PipelineTimes | None


class ModelRunner:
    def __init__(self, config: ModelConfig, loader: WeightLoader, *, dtype: torch.dtype,
                 device: str, num_blocks: int | Callable[[int], int], block_size: int, max_model_len: int,
                 num_cpu_blocks: int = 0, cores: CoreAssignment | None = None,
                 decode_backend: str = "auto", seed: int | None = None, show_progress: bool = False,
                 linear_method: str = "dense", cpu_ops: CpuOps = CpuOps.LAYERS, kv_cache_dtype: str = "auto",
                 layer_store: Callable[[torch.device, CoreAssignment], LayerStore] | None = None,
                 cuda_graph_max_batch: int = 0, int4_prefill: Int4Prefill = Int4Prefill.DEQUANTIZE,
                 batch_invariant: bool = False) -> None:
        """`layer_store`: makes the store of where decoder layers live (weight streaming), given
        the GPU's device and the cores; None: every layer resident. `kv_cache_dtype`: how both KV
        pools store K/V (engine/kv/layouts.py; auto: in `dtype`). `cuda_graph_max_batch`: GPU-only
        decode steps of up to this many sequences replay CUDA graphs, where the model allows (0: none).
        `int4_prefill`: how INT4 weights multiply chunks above the packed kernel's int16 rows
        (engine/quant/int4.py). `batch_invariant`: a prompt's rows through decode's kernels (engine/config.py)."""
        self.config = config
        self.cores = cores or CoreAssignment.for_device(device)
        self.gpu = self._make_gpu(device)
        self.device = self.gpu.device
        self.block_size = block_size
        kv_layout = create_layout(kv_cache_dtype, dtype, config.num_kv_heads, config.head_dim, block_size)
        store = layer_store(self.device, self.cores) if layer_store is not None else None
        if store is not None:
            store.use_gpu(self.gpu)
        try:
            self.model = create_model(config, loader, dtype, self.device, max_model_len,
                                      create_decode_backend(decode_backend, str(self.device), kv_layout),
                                      show_progress=show_progress,
                                      linear_method=_linear_method(linear_method, int4_prefill, batch_invariant),
                                      cpu_ops=cpu_ops, layer_store=store, batch_invariant=batch_invariant)
        except BaseException:
            if store is not None:
                store.close()
            self.gpu.close()
            raise
        if callable(num_blocks):  # sized by what the loaded weights leave of a memory budget
            num_blocks = num_blocks(self.model.gpu_weight_bytes())
        cpu_pool = None
        if num_cpu_blocks:
            cpu_pool = KVCache(config, num_cpu_blocks, block_size, dtype, "cpu",
                               pin_memory=self.device.type == "cuda", kv_cache_dtype=kv_cache_dtype)
        gpu_pool = KVCache(config, num_blocks, block_size, dtype, self.device, kv_cache_dtype=kv_cache_dtype)
        self.kv_cache = TwoTierKVCache(gpu_pool, cpu_pool)
        # The CPU-requests' attention: the C++ kernel with the CPU's share of threads.
        self.cpu_decode = None
        if num_cpu_blocks:
            self.cpu_decode = create_decode_backend(decode_backend, "cpu", kv_layout)
            if hasattr(self.cpu_decode, "num_threads"):
                self.cpu_decode.num_threads = self.cores.cpu_attention_threads
        self.sampler = Sampler(config.vocab_size, seed=seed)
        self.graphs = self._decode_graphs(cuda_graph_max_batch, max_model_len)

    def _decode_graphs(self, max_batch: int, max_model_len: int) -> DecodeGraphs | None:
        if not max_batch:
            return None
        why_not = DecodeGraphs.applies_to(self.model)
        if why_not is not None:
            logger.info("decode steps run eagerly, not as CUDA graphs: %s", why_not)
            return None
        max_blocks = -(-max_model_len // self.block_size)
        return DecodeGraphs(self.model, self.kv_cache, max_batch, max_blocks)

    def _make_gpu(self, device: str) -> GpuQueue:
        if self.cores.device == "testbed":
            return WorkerThreadQueue(set(self.cores.gpu_cores), self.cores.gpu_threads)
        if self.cores.device == "cuda":
            return CudaStreamQueue(device)
        return InlineQueue(device)

    def close(self) -> None:
        self.model.layer_store.close()
        self.gpu.close()

    # ---- what the engine reads, the same of one runner or of tensor-parallel ranks ---------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.gpu.num_blocks

    def weight_bytes(self) -> dict[tuple[str, str], int]:
        return self.model.weight_bytes()

    def begin_serving(self) -> None:
        self.model.layer_store.begin_serving()

    def profile_costs(self, **profile_kwargs):
        """This machine's cost tables for the model as it runs here (engine/profiling)."""
        from engine.profiling import profile_costs

        with self.cores.on_cpu_cores():
            return profile_costs(self.model, self.gpu, self.model.decode_backend, self.cpu_decode, **profile_kwargs)

    # ---- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: IterationPlan) -> RunnerOutput:
        start = time.perf_counter()
        logits = self._forward(plan)
        forward_time = time.perf_counter() - start
        firsts = first_output_rows(plan)
        shares = plan.scheduled
        rows = [firsts[index] for index, scheduled in enumerate(shares) if scheduled.samples]
        sampling_rows = logits.rows[rows] if len(rows) < len(shares) else logits.rows[:len(rows)]
        sampled = self.sampler(sampling_rows, [scheduled.sequence for scheduled in shares if scheduled.samples])
        verify_logits = [logits.rows[firsts[index]:firsts[index] + scheduled.num_output_rows]
                         for index, scheduled in enumerate(shares) if scheduled.is_verify]
        return RunnerOutput(sampled, forward_time, logits.pipeline, self._prompt_logprobs(plan, logits), verify_logits)

    @torch.inference_mode()
    def forward(self, plan: IterationPlan) -> ForwardLogits:
        """Run the model over the plan: each scheduled sequence's logits, then its prompt rows'."""
        return self._forward(plan)

    @torch.inference_mode()
    def compute_logits(self, plan: IterationPlan) -> torch.Tensor:
        """Run the model over the plan. -> [num_scheduled, vocab] fp32, rows in `plan.scheduled` order"""
        return self._forward(plan).rows[:len(plan.scheduled)]

    @staticmethod
    def _prompt_logprobs(plan: IterationPlan, logits: ForwardLogits) -> dict[int, list[TokenLogprob]]:
        result, first_row = {}, sum(scheduled.num_output_rows for scheduled in plan.scheduled)
        for row, num_rows in logits.prompt_spans:
            scheduled = plan.scheduled[row]
            first, end = prompt_logprob_positions(scheduled)
            targets = scheduled.sequence.prompt_token_ids[first + 1:end + 1]
            result[row] = prompt_logprobs(logits.rows[first_row:first_row + num_rows], targets,
                                          scheduled.sequence.sampling_params.prompt_logprobs)
            first_row += num_rows
        return result

    def _forward(self, plan: IterationPlan) -> ForwardLogits:
        with self.cores.on_cpu_cores():
            try:
                logits = self._forward_on_cores(plan)
            except BaseException:
                self.gpu.recover()
                self.model.layer_store.recover()
                raise
            self.model.layer_store.between_forwards()
            return logits

    def _forward_on_cores(self, plan: IterationPlan) -> ForwardLogits:
        self._copy_blocks(plan)
        rows = self._graph_rows(plan)
        if rows is not None:
            logits = self.gpu.submit(lambda: self.graphs.run(rows)).result()
            if logits is not None:
                return ForwardLogits(logits, [], None)
        if plan.mode == PlanMode.GPU_ONLY and not (plan.batch0_cpu_decodes or plan.batch1_cpu_decodes):
            batch = self._build_batch(plan.prefills, plan.decodes, [])
            output_rows = torch.cat([batch.sequence_rows, batch.prompt_rows])
            logits = self.gpu.submit(lambda: self.model.forward(
                batch.token_ids, batch.positions, self.kv_cache, batch.meta, output_rows)).result()
            return ForwardLogits(logits, batch.prompt_spans, None)
        if self.cpu_decode is None:
            raise RuntimeError("a pipelined plan needs the host KV pool, but offloading is off")
        times = PipelineTimes()
        batch0 = self._build_batch(plan.prefills, plan.decodes, plan.batch0_cpu_decodes)
        batch1 = self._build_batch([], [], plan.batch1_cpu_decodes)
        logits = pipelined_forward(self.model, self.gpu, self.kv_cache, self.cpu_decode,
                                   batch0, batch1, times)
        num_batch0_seqs = len(plan.batch0)
        spans = batch0.prompt_spans + [(num_batch0_seqs + index, num_rows) for index, num_rows in batch1.prompt_spans]
        return ForwardLogits(logits, spans, times)

    def _graph_rows(self, plan: IterationPlan) -> DecodeRows | None:
        """A GPU-only plan of decodes alone, as rows for the decode graphs; None where they do not take it."""
        decodes = plan.decodes
        if (self.graphs is None or plan.mode != PlanMode.GPU_ONLY or plan.prefills or not decodes
                or plan.batch0_cpu_decodes or plan.batch1_cpu_decodes):
            return None
        rows = [(token, share.num_computed_tokens + offset, share.sequence.block_ids)
                for share in decodes for offset, token in enumerate(share.token_ids)]  # a verify share's every row
        if not self.graphs.takes(len(rows), max(len(table) for _, _, table in rows)):
            return None
        return DecodeRows(*(list(column) for column in zip(*rows)))

    def _build_batch(self, prefills, gpu_decodes, cpu_decodes):
        return build_batch(prefills, gpu_decodes, cpu_decodes, self.block_size, self.device)

    def _copy_blocks(self, plan: IterationPlan) -> None:
        """The plan's block copies (swaps, demotions, promotions), in its order, before the forward."""
        if not plan.copies:
            return
        kv = self.kv_cache

        def copy_all() -> None:
            for copy in plan.copies:
                kv.copy_blocks([copy], to_cpu=copy.to_cpu)

        self.gpu.submit_copy(copy_all).result()


def first_output_rows(plan: IterationPlan) -> list[int]:
    """Each scheduled share's first row in a forward's logits (ForwardLogits.rows)."""
    firsts, row = [], 0
    for scheduled in plan.scheduled:
        firsts.append(row)
        row += scheduled.num_output_rows
    return firsts


def _linear_method(name: str, int4_prefill: Int4Prefill, batch_invariant: bool) -> LinearMethod:
    """Batch invariance: INT4 x as int16 and dense weights through the GEMV at every row count."""
    if name == "int4":
        return create_linear_method(name, prefill=Int4Prefill.INT16 if batch_invariant else int4_prefill)
    return create_linear_method(name, **({"row_invariant": True} if batch_invariant and name == "dense" else {}))
