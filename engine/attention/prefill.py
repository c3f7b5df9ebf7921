"""Causal prefill attention over packed sequences (varlen, no padding) through torch's SDPA; a
chunk after a cached prefix (chunked prefill, prefix caching) attends to the prefix's K/V too."""
from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      scale: float,
                      prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Causal attention over packed sequences, each through SDPA on its own tokens (no padding).
    `prefixes`: for a sequence (by its index) whose chunk follows cached tokens, their K/V
    [num_cached, kv_heads, head_dim], which every row of the chunk sees.

    q [num_tokens, num_heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    out = torch.empty_like(q)
    start = 0
    for index, length in enumerate(seq_lens):
        end = start + length
        keys, values, mask = k[start:end], v[start:end], None
        prefix = prefixes.get(index) if prefixes else None
        if prefix is not None:
            keys, values = torch.cat([prefix[0], keys]), torch.cat([prefix[1], values])
            mask = chunk_mask(length, prefix[0].shape[0], q.device)
        # SDPA wants [batch, heads, tokens, head_dim]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        ).squeeze(0).transpose(0, 1)
        start = end
    return out


@functools.lru_cache(maxsize=16)  # one per chunk shape of a forward, reused by every layer
def chunk_mask(num_rows: int, num_cached: int, device: torch.device) -> torch.Tensor:
    """[num_rows, num_cached + num_rows] bool: row i sees the cached tokens and the chunk's first i + 1."""
    return torch.ones(num_rows, num_cached + num_rows, dtype=torch.bool, device=device).tril(diagonal=num_cached)


def paged_prefill(kernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, seq_lens: list[int], prefixes: list[tuple[int, int, tuple[int, ...]]],
                  scale: float, kv_format: str | None = None, block_size: int | None = None) -> torch.Tensor:
    """Every prefill of a batch in one call of kernels/triton/paged_prefill.py (`kernels`: that
    module), each chunk reading its cached prefix straight from one layer's pool instead of
    gathering it. `prefixes`: (prefill index, cached tokens, block ids) of the chunks that have one.
    `kv_format`, `block_size`: the pool's, where it is group-quantized (kernels/kv_quant.py).

    q [num_tokens, num_heads, head_dim], k/v [num_tokens, kv_heads, head_dim] -> [num_tokens, num_heads, head_dim]
    """
    device = q.device
    num_cached = [0] * len(seq_lens)
    tables = [()] * len(seq_lens)
    for index, cached, blocks in prefixes:
        num_cached[index], tables[index] = cached, blocks
    width = max(1, max(len(table) for table in tables))
    block_tables = torch.tensor([[*table, *[0] * (width - len(table))] for table in tables],
                                dtype=torch.int32, device=device)
    query_start = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=device)
    return kernels.paged_prefill_attention(q, k, v, key_cache, value_cache, block_tables,
                                           torch.tensor(num_cached, dtype=torch.int32, device=device),
                                           query_start, scale, kv_format=kv_format, block_size=block_size)


def rowwise_prefill(decode_kernel, q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                    seq_lens: list[int], prefixes: dict[int, tuple[int, tuple[int, ...]]], slot_blocks: torch.Tensor,
                    block_size: int, scale: float, kv_format: str | None = None) -> torch.Tensor:
    """Each prefill row attended as a decode at its position would be: kernels/cpu's paged decode
    over the pool's blocks from position 0, each row on one thread (whole_sequences), so a token's
    attention has the same bits in any chunk, after a cached prefix or not. The chunk's K/V must be
    in the pool already. `prefixes`: by prefill index, (cached tokens, their block ids); `slot_blocks`
    [num_prefill_tokens]: the block each row's K/V went to; `kv_format`: the pool's where it is
    group-quantized (kernels/kv_quant.py). -> [num_tokens, num_heads, head_dim]"""
    tables, context_lens, start = [], [], 0
    for index, length in enumerate(seq_lens):
        num_cached, cached_blocks = prefixes.get(index, (0, ()))
        kept = torch.tensor(cached_blocks[:-(-num_cached // block_size)], dtype=torch.int64)
        positions = torch.arange(num_cached, num_cached + length)
        opens = (positions % block_size == 0) & (positions // block_size >= kept.numel())  # rows opening a block
        tables.append((torch.cat([kept, slot_blocks[start:start + length].cpu()[opens]]), length))
        context_lens.append(positions + 1)
        start += length
    width = max(table.numel() for table, _ in tables)
    block_tables = torch.cat([F.pad(table, (0, width - table.numel())).expand(length, width)
                              for table, length in tables]).to(torch.int32)
    return decode_kernel(q.contiguous(), key_pool, value_pool, block_tables,
                         torch.cat(context_lens).to(torch.int32), scale, whole_sequences=True,
                         num_threads=torch.get_num_threads(),
                         **({"kv_format": kv_format, "block_size": block_size} if kv_format else {}))
