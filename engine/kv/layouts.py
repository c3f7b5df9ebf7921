"""How a KV pool stores its elements: one `KVLayout` per format of --kv-cache-dtype.

`DenseLayout` keeps K/V in a float dtype: values `[layers, blocks, kv_heads, block_size, head_dim]`,
keys transposed within a block, `[layers, blocks, kv_heads, head_dim, block_size]`, so the CPU
kernel's vector loads take one element of several tokens. `QuantizedLayout` keeps each (block, kv
head) as one byte run of codes and scales, `[layers, blocks, kv_heads, unit_bytes]` uint8
(kernels/kv_quant.py), the key and value pools' unit_bytes each their side's (k8v4: INT8 keys,
INT4 values). Either way a block is `pool[layer, block]`, so swaps, prefix hits and
host-tier demotions copy blocks without knowing the format.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from kernels import kv_quant
from scheduler.block_pool import blocks_for
from scheduler.planning.kv_format import KVFormat, kv_format

Zeros = Callable[..., torch.Tensor]  # zeros(shape, dtype=...) on the pool's device


class KVLayout(Protocol):
    format: KVFormat
    block_size: int

    def allocate(self, num_layers: int, num_blocks: int, zeros: Zeros) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value pools."""

    def reads_as(self, compute_dtype: torch.dtype) -> bool:
        """Whether kernels take new K/V for these pools in `compute_dtype` as they are (a dense pool
        of another dtype needs them converted first)."""

    def fill_random(self, key_pool: torch.Tensor, value_pool: torch.Tensor) -> None:
        """Every slot of the pools (all layers) random, as K/V of this format."""

    def write(self, key_pool: torch.Tensor, value_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slot_blocks: torch.Tensor, slot_offsets: torch.Tensor) -> None:
        """One layer's pools: store `key`/`value` [num_tokens, kv_heads, head_dim] at (block, offset) slots."""

    def write_blocks(self, key_pool: torch.Tensor, value_pool: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, block_ids: Sequence[int], start: int) -> None:
        """One layer's pools: one sequence's K/V of positions `start..` into its table `block_ids`
        (from position 0). The rows may live on another device (a prefill's copy-out to the host)."""

    def read_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor, is_key: bool) -> torch.Tensor:
        """One layer's blocks `block_ids` [n] as rows [n, kv_heads, block_size, head_dim] (the compute dtype)."""

    def as_stored(self, rows: torch.Tensor, is_key: bool) -> torch.Tensor:
        """Key or value rows [..., head_dim] as a read of the pool would give them back: what a prefill attends
        to, so a prompt's tokens see the same K/V whether they were computed in this chunk or
        read from the cache (an earlier chunk, a prefix hit)."""


class DenseLayout:
    def __init__(self, fmt: KVFormat, dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        self.format, self.dtype = fmt, dtype
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size

    def allocate(self, num_layers, num_blocks, zeros):
        shape = (num_layers, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        key_shape = (*shape[:3], self.head_dim, self.block_size)
        return zeros(key_shape, dtype=self.dtype), zeros(shape, dtype=self.dtype)

    def reads_as(self, compute_dtype):
        return self.dtype == compute_dtype

    def fill_random(self, key_pool, value_pool):
        fill_tiled(key_pool, torch.Tensor.normal_)
        fill_tiled(value_pool, torch.Tensor.normal_)

    def write(self, key_pool, value_pool, key, value, slot_blocks, slot_offsets):
        # advanced indices around a slice put the token dim first: [num_tokens, kv_heads, head_dim]
        key_pool.transpose(-1, -2)[slot_blocks, :, slot_offsets] = key.to(self.dtype)
        value_pool[slot_blocks, :, slot_offsets] = value.to(self.dtype)

    def write_blocks(self, key_pool, value_pool, key, value, block_ids, start):
        head = min(-start % self.block_size, key.shape[0])  # rows finishing a block begun earlier
        if head:
            block, offset = block_ids[start // self.block_size], start % self.block_size
            key_pool[block, :, :, offset:offset + head] = key[:head].permute(1, 2, 0).to(key_pool.device)
            value_pool[block, :, offset:offset + head] = value[:head].transpose(0, 1).to(value_pool.device)
            key, value, start = key[head:], value[head:], start + head
        if key.shape[0]:
            self._write_whole_blocks(key_pool, value_pool, key, value, block_ids[start // self.block_size:])

    def _write_whole_blocks(self, key_pool, value_pool, key, value, block_ids):
        """`key`/`value` rows from the start of `block_ids[0]` on, one copy per run of adjacent blocks."""
        num_tokens, kv_heads, head_dim = key.shape
        block_ids = block_ids[:blocks_for(num_tokens, self.block_size)]
        padded = len(block_ids) * self.block_size
        # [blocks, block_size, kv_heads, head_dim] -> the pool's own layout, so each run's
        # destination is contiguous (asynchronous into pinned memory)
        for pool, rows, order in ((key_pool, key, (0, 2, 3, 1)), (value_pool, value, (0, 2, 1, 3))):
            if padded != num_tokens:  # the last block's tail is masked by context lengths
                rows = torch.cat([rows, rows.new_zeros(padded - num_tokens, kv_heads, head_dim)])
            blocks = rows.view(len(block_ids), self.block_size, kv_heads, head_dim).permute(order)
            for src, dst, count in block_runs(range(len(block_ids)), block_ids):
                pool[dst:dst + count].copy_(blocks[src:src + count], non_blocking=True)

    def read_blocks(self, pool, block_ids, is_key):
        rows = pool.transpose(-1, -2) if is_key else pool
        return rows[block_ids]

    def as_stored(self, rows, is_key):
        return rows.to(self.dtype).to(rows.dtype)  # no copy where the pool keeps the compute dtype


class QuantizedLayout:
    def __init__(self, fmt: KVFormat, compute_dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 block_size: int) -> None:
        self.format, self.compute_dtype, self.num_kv_heads = fmt, compute_dtype, num_kv_heads
        self.units = kv_quant.layout_for(fmt.name, head_dim, block_size)

    @property
    def block_size(self) -> int:
        return self.units.block_size

    def allocate(self, num_layers, num_blocks, zeros):
        return tuple(zeros((num_layers, num_blocks, self.num_kv_heads, side.unit_bytes), dtype=torch.uint8)
                     for side in (self.units.key, self.units.value))

    def reads_as(self, compute_dtype):
        return True  # quantized from any float dtype

    def fill_random(self, key_pool, value_pool):
        for pool, is_key in ((key_pool, True), (value_pool, False)):
            fill_tiled(pool, lambda tile: tile.random_(0, 256))  # codes, then the scales and mins made finite below
            for layer in pool:
                views = kv_quant.unit_views(layer, self.units.side(is_key), is_key)
                views.scales.uniform_(0.001, 0.01)
                if views.mins is not None:
                    views.mins.uniform_(-0.1, 0.0)

    def write(self, key_pool, value_pool, key, value, slot_blocks, slot_offsets):
        if key_pool.is_cuda:  # one Triton launch quantizes every row on the GPU
            from kernels.triton import kv_quant_write

            kv_quant_write.write_quantized(key_pool, value_pool, key, value, slot_blocks, slot_offsets,
                                           self.format.name, self.block_size)
            return
        for pool, rows, is_key in ((key_pool, key, True), (value_pool, value, False)):
            side = self.units.side(is_key)
            kv_quant.write_rows(kv_quant.unit_views(pool, side, is_key), side, rows, slot_blocks, slot_offsets)

    def write_blocks(self, key_pool, value_pool, key, value, block_ids, start):
        # quantized where the rows are, then the codes land in the pool's slots
        positions = torch.arange(start, start + key.shape[0], device=key_pool.device)
        table = torch.as_tensor(block_ids, dtype=torch.int64, device=key_pool.device)
        self.write(key_pool, value_pool, key, value, table[positions // self.block_size], positions % self.block_size)

    def read_blocks(self, pool, block_ids, is_key):
        side = self.units.side(is_key)
        return kv_quant.read_blocks(kv_quant.unit_views(pool, side, is_key), side, block_ids).to(self.compute_dtype)

    def as_stored(self, rows, is_key):
        return kv_quant.round_trip(rows, self.units.side(is_key).bits, is_key).to(rows.dtype)


# A prime count of elements: tiled over a pool, no two blocks start at the same phase of the tile.
RANDOM_TILE_ELEMENTS = 65521


def fill_tiled(pool: torch.Tensor, fill: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every element of `pool` from one tile filled by `fill` and repeated: each page written at copy
    speed (a generator over a whole pool takes half a second per 128 MiB), blocks still distinct."""
    if not pool.is_contiguous() or pool.numel() <= RANDOM_TILE_ELEMENTS:
        fill(pool)
        return
    flat = pool.view(-1)
    tile = fill(flat.new_empty(RANDOM_TILE_ELEMENTS))
    whole = flat.numel() // RANDOM_TILE_ELEMENTS * RANDOM_TILE_ELEMENTS
    flat[:whole].view(-1, RANDOM_TILE_ELEMENTS).copy_(tile)
    flat[whole:] = tile[:flat.numel() - whole]


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


def resolve_kv_format(kv_cache_dtype: str, compute_dtype: torch.dtype) -> KVFormat:
    """--kv-cache-dtype's format; auto: the compute dtype's."""
    return kv_format(str(compute_dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype)


def create_layout(kv_cache_dtype: str, compute_dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                  block_size: int) -> KVLayout:
    """The layout of `kv_cache_dtype` (auto: the compute dtype's)."""
    fmt = resolve_kv_format(kv_cache_dtype, compute_dtype)
    if fmt.quantized:
        return QuantizedLayout(fmt, compute_dtype, num_kv_heads, head_dim, block_size)
    return DenseLayout(fmt, getattr(torch, fmt.name), num_kv_heads, head_dim, block_size)
