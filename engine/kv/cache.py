"""The paged KV cache: one block pool per K and V, in the layout of the cache's format
(engine/kv/layouts.py: 16-bit or fp32 elements, or group-quantized INT8/INT4 units). Either way
`pool[layer, block]` is one block, so swaps stay plain block copies.

Two tiers (Neo 3.1): the GPU pool and the host pool (pinned when the GPU is a
CUDA GPU). A prefilled request lives wholly in one of them. Block ids come from the scheduler's
BlockPools; this module only owns the tensors and copies between them.
"""
from __future__ import annotations

import functools
from typing import Protocol, Sequence

import torch

from engine.kv.host_memory import host_zeros
from engine.kv.layouts import KVLayout, block_runs, create_layout
from engine.model_config import ModelConfig
from scheduler.planning.cost_model import kv_bytes_per_token
from scheduler.planning.kv_format import KVFormat


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", pin_memory: bool = False,
                 kv_cache_dtype: str = "auto") -> None:
        """`dtype`: the compute dtype (what reads return); `kv_cache_dtype`: how the pool stores
        K/V (auto: in `dtype`)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layout: KVLayout = create_layout(kv_cache_dtype, dtype, config.num_kv_heads, config.head_dim,
                                              block_size)
        if torch.device(device).type == "cpu" and not pin_memory:
            zeros = host_zeros
        else:  # pinned memory comes from the CUDA allocator, which takes no page advice
            zeros = functools.partial(torch.zeros, device=device, pin_memory=pin_memory)
        self.key, self.value = self.layout.allocate(config.num_layers, num_blocks, zeros)

    @property
    def format(self) -> KVFormat:
        return self.layout.format

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, fmt: KVFormat) -> int:
        """K and V of `block_size` tokens in every layer of `config`, stored in `fmt`."""
        return block_size * kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                               fmt.element_bytes)

    def fill_random(self) -> None:
        """Random K/V in every slot: the profiler's scratch pools, whose pages must be written
        (fresh zeroed host memory is the shared zero page, and reading it flatters kernels)."""
        self.layout.fill_random(self.key, self.value)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """Store `key`/`value` [num_tokens, kv_heads, head_dim] at the given (block, offset) slots."""
        self.layout.write(self.key[layer], self.value[layer], key, value, slot_blocks, slot_offsets)

    def write_blocks(self, layer: int, key: torch.Tensor, value: torch.Tensor, block_ids: Sequence[int],
                     start: int = 0) -> None:
        """Store one sequence's K/V of positions `start..` [num_tokens, kv_heads, head_dim] into its
        table `block_ids` (from position 0). The source may live on another device: this is the
        layer-by-layer copy-out of a prefill bound for the host pool."""
        self.layout.write_blocks(self.key[layer], self.value[layer], key, value, block_ids, start)

    def gather(self, layer: int, block_ids: Sequence[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of a sequence's first `num_tokens` positions, from its table `block_ids`:
        -> key, value [num_tokens, kv_heads, head_dim] (copies in the compute dtype, on the pool's device)."""
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.value.device)
        key, value = (self.layout.read_blocks(pool[layer], index, is_key)
                      for pool, is_key in ((self.key, True), (self.value, False)))
        # [blocks, kv_heads, block_size, head_dim] -> [blocks * block_size, kv_heads, head_dim]
        kv_heads, head_dim = key.shape[1], key.shape[3]
        key = key.transpose(1, 2).reshape(-1, kv_heads, head_dim)
        value = value.transpose(1, 2).reshape(-1, kv_heads, head_dim)
        return key[:num_tokens], value[:num_tokens]


class BlockMove(Protocol):
    """One request's swap: scheduler.scheduler.Swap satisfies this."""

    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]


class TwoTierKVCache:
    """The GPU pool (`gpu`) and the host pool (`cpu`, None when offloading is off)."""

    def __init__(self, gpu: KVCache, cpu: KVCache | None) -> None:
        self.gpu = gpu
        self.cpu = cpu

    def pool(self, on_cpu: bool) -> KVCache:
        if on_cpu and self.cpu is None:
            raise RuntimeError("the plan uses the host KV pool, but offloading is off")
        return self.cpu if on_cpu else self.gpu

    def copy_blocks(self, moves: Sequence[BlockMove], to_cpu: bool) -> int:
        """Swap out (to_cpu) or in: every layer's K and V of the given blocks, adjacent blocks
        merged into one copy per layer. Returns the number of merged runs."""
        src, dst = (self.gpu, self.pool(True)) if to_cpu else (self.pool(True), self.gpu)
        num_copies = 0
        num_layers = self.gpu.key.shape[0]
        for move in moves:
            for s, d, count in block_runs(move.src_blocks, move.dst_blocks):
                # per layer, so every copy is contiguous on both sides (asynchronous into pinned memory)
                for layer in range(num_layers):
                    dst.key[layer, d:d + count].copy_(src.key[layer, s:s + count], non_blocking=True)
                    dst.value[layer, d:d + count].copy_(src.value[layer, s:s + count], non_blocking=True)
                num_copies += 1
        return num_copies
