"""The paged KV cache: block pools on the GPU and the host (Neo's two tiers)."""
from engine.kv.cache import BlockMove, KVCache, TwoTierKVCache, block_runs
from engine.kv.host_memory import HUGE_PAGE_BYTES, host_zeros

__all__ = ["BlockMove", "HUGE_PAGE_BYTES", "KVCache", "TwoTierKVCache", "block_runs", "host_zeros"]
