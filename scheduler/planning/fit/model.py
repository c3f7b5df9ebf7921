"""LM-Offload's performance model (sec. 3.2), adapted to tandem's iteration. Plain Python, no torch.

A decode iteration's time is the maximum of the tasks that overlap in it (LM-Offload eq. 2):
- the GPU: every layer's linear work for the batch in the weight format (dense GEMMs, or the INT4
  kernels, whose per-use dequantization above their packed batch limit is in the measured curve),
  the streamed layers' loads from host memory or disk through the ring (the placement planner's
  pipeline, replayed in simulated time), and the decode attention of the sequences whose KV is
  in the GPU pool, read in the KV format;
- the CPU side (Neo): the decode attention of the sequences whose KV is in the host pool, in
  the KV format, plus a hand-off per layer, plus the ring's copies where a host copy engine makes
  them on the same cores (the testbed).
Neo's scheduler picks, per iteration, the GPU pool's sequences alone; all of them in one pass, each
layer's CPU attention beside its GPU attention; or its two sub-batches, the CPU's sequences'
linear work a second pass over the weights while the CPU attends (asymmetric pipelining). The
model predicts each and keeps the fastest.
A quantized KV format pays its quantization at every write and its widening at every read: both
are in the attention costs, measured with the kernels' fused append per format. With no host
pool the iteration is the GPU's alone (LM-Offload "without attention offloading", where a
sequence's KV must fit the GPU pool).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from scheduler.planning.fit.speculation import SpeculationGain, speculation_gain
from scheduler.planning.kv_format import KVFormat
from scheduler.planning.placement import PlannerInputs, Workload, forward_timeline
from scheduler.planning.tiers import Tier


@dataclass(frozen=True)
class AttentionCosts:
    """One layer's decode attention per context token, by KV format name: on the GPU and on the
    CPU side (at its thread count); `handoff_s`: a layer's Q/K/V to the CPU and its output back;
    `copies_on_cpu`: the ring's copies are memcpy on the CPU side's cores (a host copy engine, as on
    the testbed), so the CPU side spends their time too."""

    gpu_s_per_token: Mapping[str, float]
    cpu_s_per_token: Mapping[str, float]
    handoff_s: float = 0.0
    copies_on_cpu: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_s_per_token": dict(self.gpu_s_per_token), "cpu_s_per_token": dict(self.cpu_s_per_token),
                "handoff_s": self.handoff_s, "copies_on_cpu": self.copies_on_cpu}


@dataclass(frozen=True)
class KVCapacity:
    """Tokens each KV pool holds."""

    gpu_tokens: int
    host_tokens: int  # 0 without Neo's host pool

    def sequences(self, context_len: int, block_size: int) -> tuple[int, int]:
        """Sequences of `context_len` tokens each pool holds, whole blocks each."""
        seq_tokens = -(-context_len // block_size) * block_size
        return self.gpu_tokens // seq_tokens, self.host_tokens // seq_tokens


@dataclass(frozen=True)
class Prediction:
    """What the model expects of one configuration at the expected workload."""

    batch: int  # sequences decoded per iteration
    num_cpu_seqs: int  # of them, attended on the CPU (KV in the host pool)
    gpu_s: float  # the GPU's share of an iteration: linear work, loads, GPU attention
    cpu_s: float  # the CPU side's: attention of the CPU's sequences and its hand-offs
    ttft_s: float  # one expected-context prompt prefilled alone, chunk by chunk
    transfer_s: float = 0.0  # the ring loading streamed layers within an iteration
    speculation: tuple[SpeculationGain, ...] = ()  # one sequence's and the GPU pool's batch's, where asked for

    @property
    def iteration_s(self) -> float:
        return max(self.gpu_s, self.cpu_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.iteration_s

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "num_cpu_seqs": self.num_cpu_seqs, "gpu_s": self.gpu_s, "cpu_s": self.cpu_s,
                "iteration_s": self.iteration_s, "transfer_s": self.transfer_s, "ttft_s": self.ttft_s,
                "tokens_per_s": self.tokens_per_s, "speculation": [gain.to_dict() for gain in self.speculation]}


def predict(inputs: PlannerInputs, tiers: Sequence[Tier], num_buffers: int, layer_bytes: int, kv: KVFormat,
            attention: AttentionCosts, capacity: KVCapacity) -> Prediction | str:
    """The decode iteration and TTFT of this configuration (`inputs` carries the weight format's
    compute costs and the transfer rates; `tiers` each layer's), or why it serves no sequence."""
    work = inputs.workload
    context_len, num_layers = work.context_len, len(tiers)
    gpu_seqs, host_seqs = capacity.sequences(context_len, work.block_size)
    batch = min(work.max_num_seqs, gpu_seqs + host_seqs)
    if batch < 1:
        return f"neither KV pool holds a {context_len}-token sequence"

    def gpu_forward(num_gpu_seqs: int, num_tokens: int, rows_per_seq: int = 1) -> tuple[float, float]:
        attention_s = attention.gpu_s_per_token[kv.name] * num_gpu_seqs * rows_per_seq * context_len
        timeline, _ = forward_timeline(inputs, tiers, num_buffers, layer_bytes, num_tokens, attention_s)
        return timeline.iteration_s, timeline.transfer_s

    def gpu_forward_rows(num_seqs: int, rows_per_seq: int) -> float:  # each row attends to the context
        return gpu_forward(num_seqs, num_seqs * rows_per_seq, rows_per_seq)[0]

    ttft_s = _prefill_s(work.max_num_batched_tokens, context_len, gpu_forward)
    on_gpu = min(batch, gpu_seqs)
    choices = []
    if on_gpu:
        gpu_s, transfer_s = gpu_forward(on_gpu, on_gpu)
        choices.append(Prediction(on_gpu, 0, gpu_s, 0.0, ttft_s, transfer_s))
    num_cpu = batch - on_gpu
    if num_cpu:
        cpu_layer_s = attention.cpu_s_per_token[kv.name] * num_cpu * context_len + attention.handoff_s
        if attention.copies_on_cpu:  # each layer's share of the forward's loads, on the same cores
            cpu_layer_s += gpu_forward(on_gpu, batch)[1] / num_layers
        choices += [_one_batch(inputs, tiers, num_buffers, layer_bytes, batch, num_cpu, cpu_layer_s,
                               attention.gpu_s_per_token[kv.name] * on_gpu * context_len, ttft_s),
                    _two_batches(inputs, on_gpu, num_cpu, cpu_layer_s, gpu_forward, ttft_s)]
    best = max(choices, key=lambda p: p.tokens_per_s)
    if work.num_speculative_tokens:
        best = replace(best, speculation=_speculation(work, max(on_gpu, 1), gpu_forward_rows))
    return best


def _speculation(work: Workload, num_gpu_seqs: int, forward_s) -> tuple[SpeculationGain, ...]:
    """Speculative decoding's expected gain for one sequence and for the GPU pool's batch (the
    host pool's sequences verify too; their CPU attention is not priced here)."""
    return tuple(speculation_gain(forward_s, num_seqs, work.num_speculative_tokens)
                 for num_seqs in sorted({1, num_gpu_seqs}))


def _one_batch(inputs: PlannerInputs, tiers: Sequence[Tier], num_buffers: int, layer_bytes: int, batch: int,
               num_cpu: int, cpu_layer_s: float, gpu_attention_s: float, ttft_s: float) -> Prediction:
    """Neo's one-batch plan: every sequence in one pass, each layer's CPU attention beside its GPU
    attention (the layer waits for the slower)."""
    timeline, _ = forward_timeline(inputs, tiers, num_buffers, layer_bytes, batch, max(gpu_attention_s, cpu_layer_s))
    return Prediction(batch, num_cpu, timeline.iteration_s, 0.0, ttft_s, timeline.transfer_s)


def _two_batches(inputs: PlannerInputs, on_gpu: int, num_cpu: int, cpu_layer_s: float, gpu_forward,
                 ttft_s: float) -> Prediction:
    """Neo's asymmetric pipeline: the GPU's sequences in batch-0, the CPU's in batch-1, whose
    linear work is a second pass over each layer's weights while the CPU attends to it."""
    num_layers = inputs.shape.num_layers
    gpu_s, transfer_s = gpu_forward(on_gpu, on_gpu) if on_gpu else (0.0, 0.0)
    gpu_s += num_layers * inputs.costs.linear(num_cpu)
    return Prediction(on_gpu + num_cpu, num_cpu, gpu_s, num_layers * cpu_layer_s, ttft_s, transfer_s)


def _prefill_s(chunk_tokens: int, prompt_len: int, gpu_forward) -> float:
    """A prompt's forwards, `chunk_tokens` at a time (attention within the chunk is not charged:
    small beside the linear work at the contexts the chunks run)."""
    total, done = 0.0, 0
    while done < prompt_len:
        num_tokens = min(chunk_tokens, prompt_len - done)
        total += gpu_forward(0, num_tokens)[0]
        done += num_tokens
    return total
