"""Fixed-size KV block accounting: reference counts, free order and the prefix cache's hashes.
No tensors here.

A block is referenced by every sequence whose block table holds it (prefix caching shares full
blocks between sequences). A block whose count drops to zero is free; if it holds a full block
of known tokens it keeps that block's hash and stays findable (`lookup`) until an allocation
takes it, least recently freed first (LRU). Those are the pool's cached blocks: free for
allocation, reusable by a later prompt with the same prefix.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Number of blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """Block ids `0..num_blocks-1` with reference counts. Check with `can_allocate`, then
    `allocate`; `free` drops one reference per id. Allocations that take a cached block evict it;
    with `records_evictions` set (by whoever keeps a second level) they record (block, hash) in
    `evicted` until `take_evicted`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._by_hash: dict[bytes, int] = {}
        self._num_cached_free = 0
        self.records_evictions = False
        self.evicted: list[tuple[int, bytes]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (cached ones included: an allocation may take them)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a findable prefix."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks some sequence references, 0..1 (0 for an empty pool: offloading off)."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks, least recently freed first, or None (taking nothing) if
        there are too few. A cached block taken loses its hash (recorded in `evicted`)."""
        if num_blocks > len(self._free):
            return None
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            block_hash = self._hashes[block]
            if block_hash is not None:
                self._num_cached_free -= 1
                self._hashes[block] = None
                del self._by_hash[block_hash]
                if self.records_evictions:
                    self.evicted.append((block, block_hash))
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody references becomes free (the most
        recently freed: the last to be evicted). Give a table's blocks tail first, so a prefix's
        later blocks go before the earlier ones other prompts are likelier to share."""
        for block in block_ids:
            count = self._ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} freed more often than it was referenced")
            self._ref_counts[block] = count
            if count == 0:
                self._free[block] = None
                if self._hashes[block] is not None:
                    self._num_cached_free += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more reference to each (cached or referenced) block: a prefix hit shares them."""
        for block in block_ids:
            if self._ref_counts[block] == 0:
                del self._free[block]
                if self._hashes[block] is not None:
                    self._num_cached_free -= 1
            self._ref_counts[block] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """`block_id` (referenced) holds the full block `block_hash` names. A hash another block
        already holds keeps that block; this one stays anonymous."""
        if self._hashes[block_id] is not None or block_hash in self._by_hash:
            return
        self._hashes[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self._ref_counts[block_id] == 0:  # a demoted copy, registered free
            self._num_cached_free += 1

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest run of `hashes` from the first."""
        blocks = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def take_evicted(self) -> list[tuple[int, bytes]]:
        evicted, self.evicted = self.evicted, []
        return evicted
