"""The paged KV cache: one block pool per K and V. Values are `[layers, blocks, kv_heads, block_size,
head_dim]`; keys are transposed within a block, `[layers, blocks, kv_heads, head_dim, block_size]`, so
the CPU kernel's vector loads take one element of several tokens and its scores need no horizontal
sums (kernels/cpu). Both pools share the layout, so swaps stay plain block copies.

Two tiers (Neo 3.1): the GPU pool and the host pool (pinned when the GPU is a
CUDA GPU). A prefilled request lives wholly in one of them. Block ids come from the scheduler's
BlockPools; this module only owns the tensors and copies between them.
"""
from __future__ import annotations

import functools
from typing import Protocol, Sequence

import torch

from engine.kv.host_memory import host_zeros
from engine.model.config import ModelConfig
from scheduler.block_pool import blocks_for
from scheduler.cost_model import kv_bytes_per_token


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge (src[i] -> dst[i]) block moves into runs adjacent on both sides:
    [(src_start, dst_start, num_blocks)], so each run is one copy."""
    runs: list[list[int]] = []
    for s, d in sorted(zip(src, dst)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", pin_memory: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        key_shape = (*shape[:3], config.head_dim, block_size)
        if torch.device(device).type == "cpu" and not pin_memory:
            zeros = host_zeros
        else:  # pinned memory comes from the CUDA allocator, which takes no page advice
            zeros = functools.partial(torch.zeros, device=device, pin_memory=pin_memory)
        self.key, self.value = zeros(key_shape, dtype=dtype), zeros(shape, dtype=dtype)

    def key_rows(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s keys seen in the value layout [blocks, kv_heads, block_size, head_dim]
        (a view: writes go to the pool)."""
        return self.key[layer].transpose(-1, -2)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """K and V of `block_size` tokens in every layer of `config`."""
        return block_size * kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                               dtype.itemsize)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """Store `key`/`value` [num_tokens, kv_heads, head_dim] at the given (block, offset) slots."""
        # advanced indices around a slice put the token dim first: [num_tokens, kv_heads, head_dim]
        self.key_rows(layer)[slot_blocks, :, slot_offsets] = key
        self.value[layer][slot_blocks, :, slot_offsets] = value

    def write_blocks(self, layer: int, key: torch.Tensor, value: torch.Tensor, block_ids: Sequence[int],
                     start: int = 0) -> None:
        """Store one sequence's K/V of positions `start..` [num_tokens, kv_heads, head_dim] into its
        table `block_ids` (from position 0), one copy per run of adjacent whole blocks. The source
        may live on another device: this is the layer-by-layer copy-out of a prefill bound for the
        host pool (asynchronous into pinned memory)."""
        head = min(-start % self.block_size, key.shape[0])  # rows finishing a block begun earlier
        if head:
            block, offset = block_ids[start // self.block_size], start % self.block_size
            self.key_rows(layer)[block, :, offset:offset + head] = key[:head].transpose(0, 1).to(self.key.device)
            self.value[layer, block, :, offset:offset + head] = value[:head].transpose(0, 1).to(self.value.device)
            key, value, start = key[head:], value[head:], start + head
        if key.shape[0]:
            self._write_whole_blocks(layer, key, value, block_ids[start // self.block_size:])

    def _write_whole_blocks(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                            block_ids: Sequence[int]) -> None:
        """`key`/`value` rows from the start of `block_ids[0]` on."""
        num_tokens, kv_heads, head_dim = key.shape
        block_ids = block_ids[:blocks_for(num_tokens, self.block_size)]
        padded = len(block_ids) * self.block_size
        # [blocks, block_size, kv_heads, head_dim] -> keys [blocks, kv_heads, head_dim, block_size],
        # values [blocks, kv_heads, block_size, head_dim]: the pool's own layout, so each run's
        # destination is contiguous
        for cache, rows, order in ((self.key, key, (0, 2, 3, 1)), (self.value, value, (0, 2, 1, 3))):
            if padded != num_tokens:  # the last block's tail is masked by context lengths
                rows = torch.cat([rows, rows.new_zeros(padded - num_tokens, kv_heads, head_dim)])
            blocks = rows.view(len(block_ids), self.block_size, kv_heads, head_dim).permute(order)
            for src, dst, count in block_runs(range(len(block_ids)), block_ids):
                cache[layer, dst:dst + count].copy_(blocks[src:src + count], non_blocking=True)

    def gather(self, layer: int, block_ids: Sequence[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of a sequence's first `num_tokens` positions, from its table `block_ids`:
        -> key, value [num_tokens, kv_heads, head_dim] (copies, on the pool's device)."""
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.value.device)
        kv_heads, head_dim = self.value.shape[2], self.value.shape[4]
        # [blocks, kv_heads, block_size, head_dim] -> [blocks * block_size, kv_heads, head_dim]
        key = self.key_rows(layer)[index].transpose(1, 2).reshape(-1, kv_heads, head_dim)
        value = self.value[layer][index].transpose(1, 2).reshape(-1, kv_heads, head_dim)
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
