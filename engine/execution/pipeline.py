"""Neo's asymmetric two-batch forward (fig. 5), written against engine/execution/queues.py.

Batch-0 holds the prefills, the GPU-requests' decodes and a few CPU-requests' decodes; batch-1
holds CPU-requests' decodes only. Per layer the accelerator runs one batch's linear stages while
the CPU runs the other batch's decoding attention:

    accelerator:  [po0(i-1) pr0(i)] [ga0(i)] [po1(i-1) pr1(i)] [po0(i) pr0(i+1)] [ga0(i+1)] ...
    CPU:          ...  ca1(i-1)     |   ca0(i)                 |  ca1(i)                  | ca0(i+1)

so an iteration costs L * (max(T_l0, T_ca1) + max(T_l1 + T_ga0, T_ca0)), the time the scheduler
estimated. The calling (engine) thread conducts: it queues accelerator work in order and computes
the CPU attention itself, waiting on a future only for the Q/K/V it needs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.attention import DecodeAttentionBackend
from engine.execution.batch import BatchInputs
from engine.execution.queues import AcceleratorQueue
from engine.kv import TwoTierKVCache
from engine.model.llama import LlamaModel


@dataclass
class PipelineTimes:
    """Where the engine thread spent one pipelined forward (seconds)."""

    cpu_attention: float = 0.0  # in the CPU decoding attention kernel
    cpu_waiting: float = 0.0  # waiting for the accelerator (the CPU side of pipeline bubbles)


class _Batch:
    """Per-batch state carried from one queued closure to the next."""

    def __init__(self, inputs: BatchInputs) -> None:
        self.inputs = inputs
        self.hidden: torch.Tensor | None = None  # [num_tokens, hidden]
        self.attn_out: torch.Tensor | None = None  # [num_tokens, num_heads, head_dim]
        self.qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # this layer's, for attention


def pipelined_forward(model: LlamaModel, accelerator: AcceleratorQueue, kv_cache: TwoTierKVCache,
                      cpu_decode: DecodeAttentionBackend, batch0: BatchInputs, batch1: BatchInputs,
                      times: PipelineTimes | None = None) -> torch.Tensor:
    """-> logits [batch-0 seqs + batch-1 seqs + batch-0's then batch-1's prompt rows, vocab] fp32,
    on the accelerator."""
    times = times if times is not None else PipelineTimes()
    num_layers = model.config.num_layers
    host = torch.device("cpu")
    b0, b1 = _Batch(batch0), _Batch(batch1)

    def pre_proj(batch: _Batch, layer: int):
        """pr(layer): QKV + RoPE; the accelerator attention of batch-0 is queued separately so
        the CPU can start on its rows while it runs. Returns host views of the CPU rows."""
        inputs = batch.inputs
        q, k, v = model.pre_proj(layer, batch.hidden, inputs.positions)
        batch.attn_out = torch.empty_like(q)
        batch.qkv = (q, k, v)
        start = inputs.num_accelerator_rows
        # [num_cpu_rows, heads, head_dim] each; non-blocking device->host copies on CUDA
        return tuple(t[start:].to(host, non_blocking=True) for t in (q, k, v))

    def accelerator_attention(batch: _Batch, layer: int) -> None:
        q, k, v = batch.qkv
        if batch.inputs.num_accelerator_rows:
            model.attention(layer, q, k, v, kv_cache, batch.inputs.meta, out=batch.attn_out)

    def post_proj(batch: _Batch, layer: int, cpu_out: torch.Tensor | None) -> None:
        start = batch.inputs.num_accelerator_rows
        if cpu_out is not None:
            batch.attn_out[start:] = cpu_out.to(batch.attn_out.device, non_blocking=True)
        batch.hidden = model.post_proj(layer, batch.hidden, batch.attn_out.flatten(1))

    def cpu_attention(batch: _Batch, layer: int, rows) -> torch.Tensor | None:
        meta = batch.inputs.cpu
        if meta is None or meta.num_decodes == 0:
            return None
        q, k, v = rows
        host_pool = kv_cache.pool(on_cpu=True)
        start = time.perf_counter()
        out = cpu_decode.forward(q, host_pool.key[layer], host_pool.value[layer], meta.block_tables,
                                 meta.context_lens, model.scale, k, v)
        times.cpu_attention += time.perf_counter() - start
        return out

    def wait(future):
        start = time.perf_counter()
        value = future.result()
        times.cpu_waiting += time.perf_counter() - start
        return value

    # A plan may leave batch-1 empty (its CPU decodes all fit beside batch-0's linear work).
    has_batch1 = batch1.num_tokens > 0
    # Layer weights are held from batch-0's first stage of a layer to its last sub-batch's (with a
    # batch-1, layer i+1's batch-0 stage runs before layer i's batch-1 stage: two layers at once).
    layers = model.layer_store

    def embed() -> None:
        b0.hidden = model.pre_layer(batch0.token_ids)
        b1.hidden = model.pre_layer(batch1.token_ids)
        layers.acquire(0)

    accelerator.submit(embed)
    rows0 = accelerator.submit(lambda: pre_proj(b0, 0))
    accelerator.submit(lambda: accelerator_attention(b0, 0))
    rows1 = accelerator.submit(lambda: pre_proj(b1, 0)) if has_batch1 else None
    for layer in range(num_layers):
        nxt = layer + 1
        out0 = cpu_attention(b0, layer, wait(rows0))  # ca0(layer), under ga0(layer) + l1

        def stage0(layer=layer, out0=out0, nxt=nxt):
            post_proj(b0, layer, out0)
            if not has_batch1:
                layers.release(layer)
            if nxt == num_layers:
                return None
            layers.acquire(nxt)
            return pre_proj(b0, nxt)

        rows0 = accelerator.submit(stage0)
        if nxt < num_layers:
            accelerator.submit(lambda nxt=nxt: accelerator_attention(b0, nxt))
        if not has_batch1:
            continue
        out1 = cpu_attention(b1, layer, wait(rows1))  # ca1(layer), under l0

        def stage1(layer=layer, out1=out1, nxt=nxt):
            post_proj(b1, layer, out1)
            layers.release(layer)
            return pre_proj(b1, nxt) if nxt < num_layers else None

        rows1 = accelerator.submit(stage1)

    def head() -> torch.Tensor:
        hidden = torch.cat([b0.hidden, b1.hidden])
        last = torch.cat([batch0.last_indices, batch1.last_indices + batch0.num_tokens, batch0.prompt_rows,
                          batch1.prompt_rows + batch0.num_tokens])
        return model.post_layer(hidden, last)

    return wait(accelerator.submit(head))
