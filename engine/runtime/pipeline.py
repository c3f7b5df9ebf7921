"""Neo's asymmetric two-batch forward (fig. 5), written against engine/device/queues.py.

Batch-0 holds the prefills, the GPU-requests' decodes and a few CPU-requests' decodes; batch-1
holds CPU-requests' decodes only. Per layer the GPU runs one batch's linear stages while
the CPU runs the other batch's decoding attention:

    GPU:          [po0(i-1) pr0(i)] [ga0(i)] [po1(i-1) pr1(i)] [po0(i) pr0(i+1)] [ga0(i+1)] ...
    CPU:          ...  ca1(i-1)     |   ca0(i)                 |  ca1(i)                  | ca0(i+1)

so an iteration costs L * (max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0)), the time the scheduler
estimated. The calling (engine) thread conducts: it queues GPU work in order and computes
the CPU attention itself, waiting on a future only for the Q/K/V it needs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import DecodeAttentionBackend
from engine.runtime.batch import BatchInputs
from engine.device.queues import GpuQueue, Future
from engine.kv import TwoTierKVCache
from engine.model.llama import LlamaModel

_HOST = torch.device("cpu")


@dataclass
class PipelineTimes:
    """Where the engine thread spent one pipelined forward (seconds)."""

    cpu_attention: float = 0.0  # in the CPU decoding attention kernel
    cpu_waiting: float = 0.0  # waiting for the GPU (the CPU side of pipeline bubbles)


class _Batch:
    """Per-batch state carried from one queued closure to the next."""

    def __init__(self, inputs: BatchInputs) -> None:
        self.inputs = inputs
        self.hidden: torch.Tensor | None = None  # [num_tokens, hidden]
        self.attn_out: torch.Tensor | None = None  # [num_tokens, num_heads, head_dim]
        self.qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # this layer's, for attention


def pipelined_forward(model: LlamaModel, gpu: GpuQueue, kv_cache: TwoTierKVCache,
                      cpu_decode: DecodeAttentionBackend, batch0: BatchInputs, batch1: BatchInputs,
                      times: PipelineTimes | None = None) -> torch.Tensor:
    """-> logits [batch-0 seqs + batch-1 seqs + batch-0's then batch-1's prompt rows, vocab] fp32,
    on the GPU."""
    times = times if times is not None else PipelineTimes()
    return _PipelinedForward(model, gpu, kv_cache, cpu_decode, batch0, batch1, times).run()


class _PipelinedForward:
    """One pipelined forward, stage by stage. The GPU stages (`_embed`, `_pre_proj`,
    `_gpu_attention`, `_post_proj`, `_head`) run in the queue's order; `_cpu_attention`
    runs on the calling thread, `_wait` blocks it on a future."""

    def __init__(self, model: LlamaModel, gpu: GpuQueue, kv_cache: TwoTierKVCache,
                 cpu_decode: DecodeAttentionBackend, batch0: BatchInputs, batch1: BatchInputs,
                 times: PipelineTimes) -> None:
        self.model = model
        self.gpu = gpu
        self.kv_cache = kv_cache
        self.cpu_decode = cpu_decode
        self.times = times
        self.num_layers = model.config.num_layers
        self.b0, self.b1 = _Batch(batch0), _Batch(batch1)
        # A plan may leave batch-1 empty (its CPU decodes all fit beside batch-0's linear work).
        self.has_batch1 = batch1.num_tokens > 0
        # Layer weights are held from batch-0's first stage of a layer to its last sub-batch's (with
        # a batch-1, layer i+1's batch-0 stage runs before layer i's batch-1 stage: two layers at once).
        self.layers = model.layer_store

    def run(self) -> torch.Tensor:
        self.gpu.submit(self._embed)
        batch0_rows = self.gpu.submit(lambda: self._pre_proj(self.b0, 0))
        self.gpu.submit(lambda: self._gpu_attention(self.b0, 0))
        batch1_rows = self.gpu.submit(lambda: self._pre_proj(self.b1, 0)) if self.has_batch1 else None
        for layer in range(self.num_layers):
            batch0_rows, batch1_rows = self._conduct_layer(layer, batch0_rows, batch1_rows)
        return self._wait(self.gpu.submit(self._head))

    def _conduct_layer(self, layer: int, batch0_rows: Future, batch1_rows: Future | None) -> tuple[Future,
                                                                                                   Future | None]:
        """Computes `layer`'s CPU attention of each batch as its rows arrive and queues what
        follows it on the GPU. Returns the futures of the next layer's CPU rows."""
        nxt = layer + 1
        batch0_out = self._cpu_attention(self.b0, layer, self._wait(batch0_rows))  # ca0(layer), under ga0(layer) + l1
        batch0_rows = self.gpu.submit(lambda: self._finish_batch0_layer(layer, batch0_out))
        if nxt < self.num_layers:
            self.gpu.submit(lambda: self._gpu_attention(self.b0, nxt))
        if not self.has_batch1:
            return batch0_rows, batch1_rows
        batch1_out = self._cpu_attention(self.b1, layer, self._wait(batch1_rows))  # ca1(layer), under l0
        batch1_rows = self.gpu.submit(lambda: self._finish_batch1_layer(layer, batch1_out))
        return batch0_rows, batch1_rows

    # ---- GPU stages -----------------------------------------------------------------
    def _embed(self) -> None:
        self.b0.hidden = self.model.pre_layer(self.b0.inputs.token_ids)
        self.b1.hidden = self.model.pre_layer(self.b1.inputs.token_ids)
        self.layers.acquire(0)

    def _pre_proj(self, batch: _Batch, layer: int):
        """pr(layer): QKV + RoPE; the GPU attention of batch-0 is queued separately so
        the CPU can start on its rows while it runs. Returns host views of the CPU rows."""
        inputs = batch.inputs
        q, k, v = self.model.pre_proj(layer, batch.hidden, inputs.positions)
        batch.attn_out = torch.empty_like(q)
        batch.qkv = (q, k, v)
        start = inputs.num_gpu_rows
        # [num_cpu_rows, heads, head_dim] each; non-blocking device->host copies on CUDA
        return tuple(t[start:].to(_HOST, non_blocking=True) for t in (q, k, v))

    def _gpu_attention(self, batch: _Batch, layer: int) -> None:
        """ga(layer): the attention of the batch's GPU rows."""
        q, k, v = batch.qkv
        if batch.inputs.num_gpu_rows:
            self.model.attention(layer, q, k, v, self.kv_cache, batch.inputs.meta, out=batch.attn_out)

    def _post_proj(self, batch: _Batch, layer: int, cpu_out: torch.Tensor | None) -> None:
        """po(layer): the CPU rows' attention joins the GPU's, then O projection and MLP."""
        start = batch.inputs.num_gpu_rows
        if cpu_out is not None:
            batch.attn_out[start:] = cpu_out.to(batch.attn_out.device, non_blocking=True)
        batch.hidden = self.model.post_proj(layer, batch.hidden, batch.attn_out.flatten(1))

    def _finish_batch0_layer(self, layer: int, cpu_out: torch.Tensor | None):
        """po0(layer) pr0(layer + 1); returns the next layer's CPU rows (None after the last)."""
        self._post_proj(self.b0, layer, cpu_out)
        if not self.has_batch1:
            self.layers.release(layer)
        nxt = layer + 1
        if nxt == self.num_layers:
            return None
        self.layers.acquire(nxt)
        return self._pre_proj(self.b0, nxt)

    def _finish_batch1_layer(self, layer: int, cpu_out: torch.Tensor | None):
        """po1(layer) pr1(layer + 1); returns the next layer's CPU rows (None after the last)."""
        self._post_proj(self.b1, layer, cpu_out)
        self.layers.release(layer)
        nxt = layer + 1
        return self._pre_proj(self.b1, nxt) if nxt < self.num_layers else None

    def _head(self) -> torch.Tensor:
        batch0, batch1 = self.b0.inputs, self.b1.inputs
        hidden = torch.cat([self.b0.hidden, self.b1.hidden])
        last = torch.cat([batch0.sequence_rows, batch1.sequence_rows + batch0.num_tokens, batch0.prompt_rows,
                          batch1.prompt_rows + batch0.num_tokens])
        return self.model.post_layer(hidden, last)

    # ---- calling-thread stages --------------------------------------------------------------
    def _cpu_attention(self, batch: _Batch, layer: int, rows) -> torch.Tensor | None:
        """ca(layer): the decoding attention of the batch's CPU rows, over the host KV pool."""
        meta = batch.inputs.cpu
        if meta is None or meta.num_decodes == 0:
            return None
        q, k, v = rows
        host_pool = self.kv_cache.pool(on_cpu=True)
        start = time.perf_counter()
        out = self.cpu_decode.forward(q, host_pool.key[layer], host_pool.value[layer], meta.block_tables,
                                      meta.context_lens, self.model.scale, k, v)
        self.times.cpu_attention += time.perf_counter() - start
        return out

    def _wait(self, future: Future):
        start = time.perf_counter()
        value = future.result()
        self.times.cpu_waiting += time.perf_counter() - start
        return value
