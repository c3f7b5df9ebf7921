"""Automatic prefix caching: which full KV blocks a new prompt can take from a pool instead of
computing them.

A full block is named by a hash chained over its parent block's hash and its token ids, rooted in
a key that holds whatever else changes KV (the model, its dtype and quantization, the block
size): two blocks with the same hash hold the same K/V. The pools (scheduler/block_pool.py) keep
a hash per full block a sequence has computed; a block freed keeps its hash until an allocation
evicts it, so a later prompt that starts with the same tokens shares it (reference-counted).

A prompt's hit is capped below its last token: the last prompt token is always computed, for its
logits, and hits are whole blocks, so the block holding that token is computed again in a block
of the sequence's own (no sequence ever writes into a shared block).

Counters follow vLLM's: queries and hits in tokens, per KV tier looked up. Every admitted prompt
counts all its tokens as GPU-pool queries; the host pool's queries are the tokens it was asked
for after the GPU pool's hits, so the overall hit rate is the hits of both over the GPU's queries.
"""
from __future__ import annotations

import copy
import hashlib
from array import array
from dataclasses import dataclass, field

from scheduler.block_pool import BlockPool
from scheduler.sequence import Sequence

HASH_BYTES = 16  # blake2b-128: a collision among a pool's blocks is out of reach (2^-64 per pair at worst)


def root_hash(key: str) -> bytes:
    """The parent of every prompt's first block: what, besides the tokens, makes K/V what it is."""
    return hashlib.blake2b(key.encode(), digest_size=HASH_BYTES).digest()


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block holding `token_ids`, after the block hashed `parent`."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class PrefixCacheCounters:
    """Cumulative counts, for metrics: tokens looked up and found, by KV tier (`gpu`, `cpu`), and
    blocks moved between the tiers' caches."""

    queries: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0})
    hits: dict[str, int] = field(default_factory=lambda: {"gpu": 0, "cpu": 0})
    num_demoted_blocks: int = 0  # evicted from the GPU pool, kept in the host pool
    num_promoted_blocks: int = 0  # found in the host pool, copied into the GPU pool

    def snapshot(self) -> PrefixCacheCounters:
        return copy.deepcopy(self)

    def since(self, before: PrefixCacheCounters) -> PrefixCacheCounters:
        """What was counted after `before`, a snapshot of these counters (the engine reports each
        iteration's share this way)."""
        return PrefixCacheCounters(
            queries={tier: n - before.queries[tier] for tier, n in self.queries.items()},
            hits={tier: n - before.hits[tier] for tier, n in self.hits.items()},
            num_demoted_blocks=self.num_demoted_blocks - before.num_demoted_blocks,
            num_promoted_blocks=self.num_promoted_blocks - before.num_promoted_blocks)


class PrefixCache:
    """Block hashes of sequences, lookups in a pool and registration of computed blocks."""

    def __init__(self, block_size: int, key: str, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.root = root_hash(f"{key}|block_size={block_size}")
        self.counters = PrefixCacheCounters()

    def hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The hashes of `seq`'s full blocks within its first `num_tokens` tokens, computed once
        per block and kept on the sequence."""
        num_blocks = num_tokens // self.block_size
        known = seq.block_hashes
        if len(known) < num_blocks:
            tokens = seq.all_token_ids
            parent = known[-1] if known else self.root
            for index in range(len(known), num_blocks):
                start = index * self.block_size
                parent = chain_hash(parent, tokens[start:start + self.block_size])
                known.append(parent)
        return known[:num_blocks]

    def cacheable_blocks(self, seq: Sequence) -> int:
        """How many of `seq`'s blocks a hit may cover: full blocks below its last token; none for
        a sequence asking for prompt logprobs (it computes the rows it needs)."""
        if not self.enabled or seq.wants_prompt_logprobs:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def match(self, seq: Sequence, pool: BlockPool, skip_blocks: int = 0) -> list[int]:
        """The blocks of `pool` holding `seq`'s longest cached prefix after its first
        `skip_blocks` blocks (found elsewhere), capped by `cacheable_blocks`. Takes no reference."""
        limit = self.cacheable_blocks(seq)
        if limit <= skip_blocks:
            return []
        return pool.lookup(self.hashes(seq, limit * self.block_size)[skip_blocks:])

    def commit(self, seq: Sequence, pool: BlockPool) -> None:
        """Make `seq`'s full computed blocks findable in `pool`, the pool holding them."""
        num_full_blocks = seq.num_computed_tokens // self.block_size
        if not self.enabled or num_full_blocks <= seq.num_committed_blocks:
            return
        hashes = self.hashes(seq, num_full_blocks * self.block_size)
        for index in range(seq.num_committed_blocks, num_full_blocks):
            pool.register(seq.block_ids[index], hashes[index])
        seq.num_committed_blocks = num_full_blocks

    def record_admission(self, tier: str, num_tokens: int, num_hit_tokens: int, sign: int = 1) -> None:
        """Count an admission into `tier`'s pool that found `num_hit_tokens` of its `num_tokens`
        cached there: its prompt once against the GPU pool, and, into the host pool, the host
        pool's lookup too (sign -1: the admission was undone)."""
        if not self.enabled:
            return
        self.record("gpu", num_tokens, num_hit_tokens if tier == "gpu" else 0, sign)
        if tier == "cpu":
            self.record("cpu", num_tokens, num_hit_tokens, sign)

    def record(self, tier: str, num_queried_tokens: int, num_hit_tokens: int, sign: int = 1) -> None:
        """Count one lookup in `tier` (sign -1: the admission was undone)."""
        self.counters.queries[tier] += sign * num_queried_tokens
        self.counters.hits[tier] += sign * num_hit_tokens
