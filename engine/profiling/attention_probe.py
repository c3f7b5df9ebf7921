"""Decode attention per KV format on this machine: what the fit (scheduler/planning/fit) weighs a KV format's
reads, widening and quantizing writes by. One layer's C++ paged decode with the fused append of
each step's new K/V, on a pool of the model's heads in the format, the blocks drawn from a pool
larger than the caches (timings on warm caches ran fast), at a few threads; well under a second
per format."""
from __future__ import annotations

import dataclasses
import functools

import torch

from engine.attention import create_decode_backend
from engine.kv import KVCache
from engine.kv.layouts import resolve_kv_format
from engine.model_config import ModelConfig
from engine.profiling.profiler import median_seconds

PROBE_SEQUENCES = 4
PROBE_CONTEXT_TOKENS = 1024
POOL_BYTES = 128 * 2**20  # blocks are spread over a pool past the last-level cache


@functools.lru_cache(maxsize=None)  # once per process: every engine of a process runs on the same hardware
def measure_attention_s_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str, block_size: int,
                                  num_threads: int) -> float:
    """One layer's decode attention per context token held, KV stored as `kv_cache_dtype`, on the
    calling thread with `num_threads` kernel threads."""
    one_layer = dataclasses.replace(config, num_layers=1)
    block_bytes = KVCache.bytes_per_block(one_layer, block_size, resolve_kv_format(kv_cache_dtype, dtype))
    blocks_per_seq = -(-PROBE_CONTEXT_TOKENS // block_size)
    num_blocks = max(PROBE_SEQUENCES * blocks_per_seq, POOL_BYTES // block_bytes)
    cache = KVCache(one_layer, num_blocks, block_size, dtype, kv_cache_dtype=kv_cache_dtype)
    cache.fill_random()
    backend = create_decode_backend("cpu", "cpu", cache.layout)
    backend.num_threads = num_threads
    generator = torch.Generator().manual_seed(0)
    # each sequence's blocks scattered over the pool, as a running server's are
    tables = torch.randperm(num_blocks, generator=generator)[:PROBE_SEQUENCES * blocks_per_seq]
    tables = tables.view(PROBE_SEQUENCES, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((PROBE_SEQUENCES,), PROBE_CONTEXT_TOKENS, dtype=torch.int32)
    query = torch.randn(PROBE_SEQUENCES, config.num_heads, config.head_dim, generator=generator).to(dtype)
    new_kv = torch.randn(PROBE_SEQUENCES, config.num_kv_heads, config.head_dim, generator=generator).to(dtype)
    scale = config.head_dim ** -0.5

    def step() -> None:
        backend.forward(query, cache.key[0], cache.value[0], tables, context_lens, scale, new_kv, new_kv)
    seconds = median_seconds(step, warmup=2, repetitions=5)
    return seconds / (PROBE_SEQUENCES * PROBE_CONTEXT_TOKENS)

