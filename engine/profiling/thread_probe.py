"""How fast the host's tasks run at each thread count: what the thread planner
(scheduler/planning/threads.py, LM-Offload's Algorithm 3) predicts splits from. Small ops are bundled
into one task each, as the paper does, and each task is timed alone at n threads on a fresh
thread kept to the first n cores, for n over `probe_thread_counts`:

- linear: one decoder layer's linear work (fused QKV, O, gate/up, down) at a decode batch,
  through the engine's weight objects: the testbed GPU thread's work, and CC's on the CPU side;
- attention: the CPU decoding attention (the engine's backend; the C++ kernel at n threads)
  over the paged KV of a decode batch;
- copy: a host memcpy of one layer's image through a host copy engine of n threads.

Each task's data (layers' weights, the KV pool, the copy's source) spans COLD_WEIGHT_BYTES, so it
comes from memory as in a forward. About a second on the 2-core VM for the embedded model.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.attention import create_decode_backend
from engine.offload.transfer import create_copy_engine
from engine.model_config import ModelConfig
from engine.profiling.streaming_probe import COLD_WEIGHT_BYTES, WEIGHT_STD, _median_s, _on_thread, measure_copy_s
from engine.quant import LinearWeight, create_linear_method
from scheduler.planning.threads import TaskProfile

DECODE_TOKENS = 16  # rows of the probe's GEMMs and sequences of its attention: a decode batch
# Every count up to this is measured; above it, counts growing by COUNT_GROWTH, and the largest two.
SMALL_THREAD_COUNTS = 8
COUNT_GROWTH = 1.5
MAX_PROBE_LAYERS = 256  # copies of one layer's weights timed back to back, at most


@dataclass(frozen=True)
class ThreadProfiles:
    """The probe's result: each task's seconds by thread count, with the size of its unit."""

    linear: TaskProfile  # one decoder layer's linear work at `decode_tokens` rows
    layer_weight_bytes: int  # the weights that work reads
    attention: TaskProfile  # the decoding attention of `decode_tokens` sequences
    attention_kv_bytes: int  # the KV it reads
    copy: TaskProfile  # one host memcpy of `copy_bytes`
    copy_bytes: int
    decode_tokens: int = DECODE_TOKENS

    def to_dict(self) -> dict[str, Any]:
        return {"linear": self.linear.to_dict(), "layer_weight_bytes": self.layer_weight_bytes,
                "attention": self.attention.to_dict(), "attention_kv_bytes": self.attention_kv_bytes,
                "copy": self.copy.to_dict(), "copy_bytes": self.copy_bytes, "decode_tokens": self.decode_tokens}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ThreadProfiles":
        return cls(TaskProfile.from_dict(data["linear"]), int(data["layer_weight_bytes"]),
                   TaskProfile.from_dict(data["attention"]), int(data["attention_kv_bytes"]),
                   TaskProfile.from_dict(data["copy"]), int(data["copy_bytes"]), int(data["decode_tokens"]))


def probe_thread_counts(max_threads: int) -> tuple[int, ...]:
    """Every count up to SMALL_THREAD_COUNTS, then a ladder growing by COUNT_GROWTH, and
    `max_threads` and one less (the testbed's GPU at most, and the CPU side off the testbed)."""
    counts = set(range(1, min(max_threads, SMALL_THREAD_COUNTS) + 1))
    count = SMALL_THREAD_COUNTS
    while count < max_threads:
        count = math.ceil(count * COUNT_GROWTH)
        counts.add(min(count, max_threads))
    counts |= {max_threads, max(1, max_threads - 1)}
    return tuple(sorted(counts))


def measure_thread_profiles(config: ModelConfig, dtype: torch.dtype, block_size: int,
                            cores: Sequence[int]) -> ThreadProfiles:
    """The three tasks of the module's docstring at every `probe_thread_counts(len(cores))` count,
    on the first n of `cores` (the cores this process may run on)."""
    counts = probe_thread_counts(len(cores))
    linear, layer_bytes = _measure_linear(config, dtype, cores, counts)
    attention, kv_bytes = _measure_attention(config, dtype, block_size, cores, counts)
    copy = TaskProfile({n: _copy_seconds(layer_bytes, cores[:n]) for n in counts})
    return ThreadProfiles(linear, layer_bytes, attention, kv_bytes, copy, layer_bytes)


def _keep_to(cores: Sequence[int], num_threads: int) -> Callable[[], None]:
    """A probe thread's set-up: these cores and this many torch threads, as the testbed's GPU
    thread and the engine thread keep to theirs."""
    def initialize() -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(num_threads)
    return initialize


def _timed(run: Callable[[], Any], cores: Sequence[int], counts: Sequence[int],
           set_count: Callable[[int], None] = lambda num_threads: None) -> TaskProfile:
    """Median seconds of `run` at each count (after `set_count(n)`), each on a fresh thread, so
    torch's pool for it is made at that count, on those cores."""
    seconds = {}
    for n in counts:
        set_count(n)
        seconds[n] = _on_thread(lambda: _median_s(run), _keep_to(cores[:n], n))
    return TaskProfile(seconds)


# ---- the tasks ----------------------------------------------------------------------------------
def _measure_linear(config: ModelConfig, dtype: torch.dtype, cores: Sequence[int],
                    counts: Sequence[int]) -> tuple[TaskProfile, int]:
    """One layer's four GEMMs at DECODE_TOKENS rows, over copies of the layer that spill the caches."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    shapes = [(config.q_size + 2 * config.kv_size, hidden), (hidden, config.q_size),
              (2 * intermediate, hidden), (hidden, intermediate)]
    method = create_linear_method("dense")
    generator = torch.Generator().manual_seed(0)
    first = [torch.randn(shape, generator=generator) * WEIGHT_STD for shape in shapes]
    layer_bytes = sum(w.numel() for w in first) * dtype.itemsize
    num_layers = max(1, min(MAX_PROBE_LAYERS, math.ceil(COLD_WEIGHT_BYTES / layer_bytes)))
    # clone(): a weight already in `dtype` would otherwise share one tensor across the copies
    layers = [[method.create_weight(w.clone(), None, dtype=dtype, device=torch.device("cpu")) for w in first]
              for _ in range(num_layers)]
    inputs = [torch.randn(DECODE_TOKENS, in_features, generator=generator).to(dtype) for _, in_features in shapes]

    def run() -> None:
        for weights in layers:
            _apply_all(weights, inputs)
    profile = _timed(run, cores, counts)
    return profile.scaled(1.0 / num_layers), layer_bytes


def _apply_all(weights: list[LinearWeight], inputs: list[torch.Tensor]) -> None:
    for weight, x in zip(weights, inputs):
        weight.apply(x)


def _measure_attention(config: ModelConfig, dtype: torch.dtype, block_size: int, cores: Sequence[int],
                       counts: Sequence[int]) -> tuple[TaskProfile, int]:
    """DECODE_TOKENS sequences attending over a pool of COLD_WEIGHT_BYTES, their blocks scattered."""
    num_kv_heads, head_dim = config.num_kv_heads, config.head_dim
    token_bytes = 2 * num_kv_heads * head_dim * dtype.itemsize  # K and V of one token, one layer
    blocks_per_seq = max(1, COLD_WEIGHT_BYTES // (DECODE_TOKENS * token_bytes * block_size))
    num_blocks = DECODE_TOKENS * blocks_per_seq
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=generator).to(dtype)
    keys = values.transpose(-1, -2).contiguous()  # [blocks, kv_heads, head_dim, block_size]
    query = torch.randn(DECODE_TOKENS, config.num_heads, head_dim, generator=generator).to(dtype)
    new_kv = torch.randn(DECODE_TOKENS, num_kv_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator, dtype=torch.int32).view(DECODE_TOKENS, blocks_per_seq)
    context_lens = torch.full((DECODE_TOKENS,), blocks_per_seq * block_size, dtype=torch.int32)
    backend = create_decode_backend("auto", "cpu")
    scale = head_dim ** -0.5

    def run() -> None:
        backend.forward(query, keys, values, tables, context_lens, scale, new_kv, new_kv)
    def set_count(num_threads: int) -> None:  # the C++ backend's (the torch reference takes its caller's)
        if hasattr(backend, "num_threads"):
            backend.num_threads = num_threads
    # the C++ kernel's workers keep the cores they start on: start them from this thread, on
    # the process's cores, rather than from a probe thread kept to a few
    set_count(counts[-1])
    run()
    return _timed(run, cores, counts, set_count), num_blocks * block_size * token_bytes


def _copy_seconds(nbytes: int, cores: Sequence[int]) -> float:
    """One layer's memcpy through a host copy engine of len(cores) threads kept to `cores`."""
    engine = create_copy_engine("cpu", len(cores), frozenset(cores))
    try:
        return measure_copy_s(engine, nbytes, source_bytes=COLD_WEIGHT_BYTES)
    finally:
        engine.close()
