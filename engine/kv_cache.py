"""The paged KV cache: one block pool per K and V, `[layers, blocks, kv_heads, block_size, head_dim]`.

Block ids come from the scheduler's BlockPool; this module only owns the tensors.
"""
from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        # [layers, blocks, kv_heads, block_size, head_dim]
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * block_size * config.head_dim * element_size

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """Store `key`/`value` [num_tokens, kv_heads, head_dim] at the given (block, offset) slots."""
        # advanced indices around a slice put the token dim first: [num_tokens, kv_heads, head_dim]
        self.key[layer][slot_blocks, :, slot_offsets] = key
        self.value[layer][slot_blocks, :, slot_offsets] = value
