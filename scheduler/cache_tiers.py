"""The host KV pool as the prefix cache's second level (Neo's two tiers, used as vLLM's offloading
connector and SGLang's HiCache use host memory): cached blocks the GPU pool evicts are demoted to
the host pool while it has free blocks, instead of being dropped; a later prompt that finds its
prefix there either has those blocks promoted (copied) into the GPU pool or, admitted as a
CPU-sequence, decodes from them where they are (the Neo scheduler chooses).

Copies are recorded in the plan and run before its forward, in order. Demotions read GPU blocks
as they were before the plan, so they run first. The host blocks a promotion or a swap-in reads
are pinned (referenced) until the plan's results come back, so no copy of this plan can write into them.
"""
from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.prefix_cache import PrefixCache
from scheduler.iteration_plan import BlockCopy, IterationPlan


def carry_hashes(src_pool: BlockPool, src_blocks: list[int], dst_pool: BlockPool, dst_blocks: list[int]) -> None:
    """A swap copies blocks between the pools: their cached prefixes stay findable in the destination."""
    for src, dst in zip(src_blocks, dst_blocks):
        block_hash = src_pool.hash_of(src)
        if block_hash is not None:
            dst_pool.register(dst, block_hash)


class HostCacheTier:
    """Demotion, promotion and the pins between plans, over the GPU pool and the host pool."""

    def __init__(self, prefix_cache: PrefixCache, gpu_pool: BlockPool, cpu_pool: BlockPool) -> None:
        self.prefix_cache = prefix_cache
        self.gpu_pool = gpu_pool
        self.cpu_pool = cpu_pool
        self._pinned: list[int] = []  # host blocks read by the last plan's copies

    def release_pins(self) -> None:
        """The last plan's copies are done (its forward ran, or it is being replaced): its pinned
        host blocks go back to their owners."""
        self.cpu_pool.free(self._pinned)
        self._pinned = []

    def pin(self, host_blocks: list[int]) -> None:
        """Keep `host_blocks` (already referenced or cached) unwritable until the next plan."""
        self.cpu_pool.touch(host_blocks)
        self._pinned.extend(host_blocks)

    def promote(self, host_blocks: list[int], gpu_blocks: list[int], plan: IterationPlan) -> None:
        """Copy cached host blocks into GPU blocks the caller allocated, findable there at once
        (the copy runs before the forward that reads them)."""
        self.pin(host_blocks)
        carry_hashes(self.cpu_pool, host_blocks, self.gpu_pool, gpu_blocks)
        plan.copies.append(BlockCopy(tuple(host_blocks), tuple(gpu_blocks), to_cpu=False))
        self.prefix_cache.counters.num_promoted_blocks += len(host_blocks)

    def finish_plan(self, plan: IterationPlan) -> None:
        """Demote the cached blocks this plan's GPU allocations evicted, while the host pool has
        free blocks and does not hold the same prefix already (the host pool's own evictions are dropped)."""
        sources, destinations = [], []
        # at most the blocks free now, so no demotion evicts another's destination
        num_free = self.cpu_pool.num_free_blocks
        for gpu_block, block_hash in self.gpu_pool.take_evicted():
            if self.cpu_pool.contains(block_hash) or len(sources) == num_free:
                continue
            [host_block] = self.cpu_pool.allocate(1)
            self.cpu_pool.register(host_block, block_hash)
            self.cpu_pool.free([host_block])  # cached, not referenced: any allocation may take it
            sources.append(gpu_block)
            destinations.append(host_block)
        if sources:
            plan.copies.insert(0, BlockCopy(tuple(sources), tuple(destinations), to_cpu=True))
            self.prefix_cache.counters.num_demoted_blocks += len(sources)
