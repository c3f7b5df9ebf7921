"""Fixed-size KV block accounting: which block ids are free. No tensors here."""
from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A free list of block ids `0..num_blocks-1`. Check with `can_allocate`, then `allocate`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (0 for an empty pool: offloading off)."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks, or None (taking nothing) if there are too few."""
        if num_blocks > len(self._free):
            return None
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
