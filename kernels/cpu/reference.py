"""Plain torch paged decode attention: the ground truth for tests and benchmarks.

Same signature and cache layouts as kernels.cpu.paged_decode_attention (keys
transposed within a block). Blocks are gathered into a
dense [batch, kv_heads, tokens, head_dim] tensor and softmax runs in fp32 with
positions past each context length masked out. Sequences are processed in
chunks so the fp32 copy of the gathered KV stays bounded.
"""

from __future__ import annotations

import torch

# Upper bound on the fp32 gathered K plus V of one chunk of sequences.
GATHER_BYTES = 256 << 20


def append_kv(key_cache, value_cache, block_tables, context_lens, new_key, new_value) -> None:
    """Writes new_key/new_value [batch, kv_heads, head_dim] at position context_lens - 1."""
    block_size = value_cache.shape[2]
    positions = context_lens.long() - 1  # [batch]
    rows = torch.arange(block_tables.shape[0])
    blocks = block_tables[rows, positions // block_size].long()  # [batch]
    key_cache.transpose(-1, -2)[blocks, :, positions % block_size] = new_key  # writes through the view
    value_cache[blocks, :, positions % block_size] = new_value


def _attend_chunk(query, key_cache, value_cache, block_tables, context_lens, scale):
    # query [batch, num_heads, head_dim]; returns fp32 [batch, num_heads, head_dim]
    batch, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = value_cache.shape
    group_size = num_heads // num_kv_heads
    num_seq_blocks = int((context_lens.max().item() + block_size - 1) // block_size)
    # Entries past a sequence's length may be anything; point them at block 0 and mask.
    ids = block_tables[:, :num_seq_blocks].long()  # [batch, blocks]
    used = torch.arange(num_seq_blocks) * block_size < context_lens.long()[:, None]
    ids = torch.where(used, ids, torch.zeros_like(ids))

    def gather(cache):  # -> [batch, kv_heads, blocks * block_size, head_dim] fp32
        dense = cache[ids].float()  # [batch, blocks, kv_heads, block_size, head_dim]
        return dense.permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)

    keys, values = gather(key_cache.transpose(-1, -2)), gather(value_cache)
    q = query.float().view(batch, num_kv_heads, group_size, head_dim) * scale
    scores = q @ keys.transpose(-1, -2)  # [batch, kv_heads, group_size, tokens]
    positions = torch.arange(scores.shape[-1])
    mask = positions[None, :] >= context_lens.long()[:, None]  # [batch, tokens]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    result = (probs @ values).view(batch, num_heads, head_dim)
    return torch.where((context_lens > 0)[:, None, None], result, torch.zeros_like(result))


def paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale, *, out=None,
                           new_key=None, new_value=None, num_threads=None) -> torch.Tensor:
    """Reference attention of one decode step; num_threads is accepted and ignored."""
    del num_threads
    if new_key is not None:
        append_kv(key_cache, value_cache, block_tables, context_lens, new_key, new_value)
    if out is None:
        out = torch.empty_like(query)
    batch = query.shape[0]
    if batch == 0:
        return out
    num_kv_heads, head_dim = value_cache.shape[1], value_cache.shape[3]
    bytes_per_seq = 2 * 4 * num_kv_heads * head_dim * max(int(context_lens.max().item()), 1)
    chunk = max(1, GATHER_BYTES // bytes_per_seq)
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        out[rows] = _attend_chunk(query[rows], key_cache, value_cache, block_tables[rows], context_lens[rows],
                                  scale).to(out.dtype)
    return out


def dotted_decode_attention(query, key_pool, value_pool, block_tables, context_lens, scale, layout) -> torch.Tensor:
    """The decode attention of a kernel that attends quantized KV by integer dot products
    (kernels.cpu.integer_dot_isas(); attention_quant_impl.h), as one thread walking each whole
    sequence block by block: the query as kv_quant.query_round_trip reads it; the online softmax;
    each block's value weights p * scale rounded to u8 codes per value group and head with step
    max / 255, INT4's mins weighted by p exactly. `layout`: the pools' kv_quant.FormatLayout.
    -> fp32 [batch, num_heads, head_dim]"""
    from kernels import kv_quant

    keys = kv_quant.dequantize_pool(key_pool, layout.key, True)  # [blocks, kv_heads, head_dim, block_size]
    values = kv_quant.unit_views(value_pool, layout.value, False)
    if layout.value.has_min:
        codes = kv_quant.unpack_nibbles(values.codes).float()  # [blocks, kv_heads, block_size, head_dim]
    else:
        codes = values.codes.view(torch.int8).float()
    batch, num_heads, head_dim = query.shape
    group_size = num_heads // key_pool.shape[1]
    groups = head_dim // kv_quant.GROUP_SIZE
    out = torch.empty(batch, num_heads, head_dim)
    for seq in range(batch):
        q = kv_quant.query_round_trip(query[seq].float() * scale)
        context = int(context_lens[seq])
        for head in range(num_heads):
            kv_head = head // group_size
            run_max, total, acc = float("-inf"), 0.0, torch.zeros(groups, kv_quant.GROUP_SIZE)
            for index in range(-(-context // layout.block_size)):
                block = int(block_tables[seq, index])
                count = min(layout.block_size, context - index * layout.block_size)
                scores = q[head] @ keys[block, kv_head, :, :count]
                new_max = max(run_max, scores.max().item())
                correction = torch.exp(torch.tensor(run_max - new_max)).item() if run_max > float("-inf") else 0.0
                total, acc, run_max = total * correction, acc * correction, new_max
                p = torch.exp(scores - run_max)
                total += p.sum().item()
                weights = p * values.scales[block, kv_head, :, :count].float()  # [groups, count]
                largest = weights.amax(-1, keepdim=True)
                step = largest / 255
                rounded = torch.where(largest > 0, (weights * (255 / torch.where(largest > 0, largest, 1))).round(), 0)
                block_codes = codes[block, kv_head, :count].view(count, groups, kv_quant.GROUP_SIZE)
                acc += step * torch.einsum("gt,tgc->gc", rounded, block_codes)
                if layout.value.has_min:
                    acc += (p * values.mins[block, kv_head, :, :count].float()).sum(-1, keepdim=True)
            out[seq, head] = (acc / total).flatten()
    return out


def quantized_pool_attention(query, key_pool, value_pool, block_tables, context_lens, scale, layout,
                             integer_dots: bool) -> torch.Tensor:
    """What kernels.cpu's decode attention gives over quantized pools (`layout`: their
    kv_quant.FormatLayout) with each sequence on one thread: dotted_decode_attention's where the
    instruction set attends by integer dot products, else attention over the dequantized pools."""
    from kernels import kv_quant

    if integer_dots:
        return dotted_decode_attention(query, key_pool, value_pool, block_tables, context_lens, scale, layout)
    return paged_decode_attention(query.float(), kv_quant.dequantize_pool(key_pool, layout.key, True),
                                  kv_quant.dequantize_pool(value_pool, layout.value, False), block_tables,
                                  context_lens, scale)
