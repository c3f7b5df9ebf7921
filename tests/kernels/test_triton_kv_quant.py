"""Triton kernels over group-quantized KV pools (kernels/kv_quant.py's layout) against its plain
torch reference on the CPU, run on CPU tensors under Triton's interpreter and, where a GPU is,
compiled on CUDA tensors (the `triton_*` fixtures of tests/conftest.py): the quantizing slot write
byte for byte against `write_rows` (round-half-even ties, zero-range groups, bf16 rows), and paged
attention reading the codes against the 16-bit reference over `dequantize_pool`'s copy of the same
pools."""
import pytest
import torch

from kernels import kv_quant

FORMATS = ["int8", "int4", "k8v4"]


def on(device, *tensors):
    """The test's inputs, made on the CPU, where its kernels run (the same tensors for cpu)."""
    return tuple(tensor.to(device) for tensor in tensors)


def tolerance(dtype, device, want, interpreted_eps):
    """assert_close's tolerances against the fp32 reference: 1e-5 for fp32. Half precision
    interpreted, fp32 inside: `interpreted_eps` of the dtype (the output's rounding, the rotated
    query's). On CUDA the dots take the dtype: the dequantized keys and values are rounded to it
    (eps / 2 each, which moves the scores by about eps of their size), the softmax weights too:
    8 eps of max |want|, some 3 times the worst of an emulation of that rounding over 100 draws."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    eps = torch.finfo(dtype).eps
    if device == "cpu":
        return dict(atol=interpreted_eps * eps, rtol=interpreted_eps * eps)
    return dict(atol=8 * eps * float(want.abs().max()), rtol=0)


def random_pool(gen, layout, num_blocks, num_kv_heads):
    """Random bytes everywhere, in units of one side's `layout`: the slots not written must keep theirs."""
    return torch.randint(0, 256, (num_blocks, num_kv_heads, layout.unit_bytes), generator=gen, dtype=torch.uint8)


def with_ties(rows, bits):
    """Rows whose first groups quantize with scale exactly 1 in `bits`-bit codes, so that x / scale
    lands on .5 ties (round half to even tells them apart), and one group of zero range."""
    ties = torch.arange(-7, 8).float() + 0.5  # -6.5 .. 7.5
    if bits == 8:
        group = torch.cat([torch.tensor([127.0]), ties.repeat(5)[:63]])
    else:
        group = torch.cat([torch.tensor([0.0, 15.0]), (ties + 7).repeat(5)[:62]])
    rows[0, 0, :kv_quant.GROUP_SIZE] = group
    rows[-1, -1, -kv_quant.GROUP_SIZE:] = 0.0 if bits == 8 else 0.25  # zero range: scale 0, codes 0
    return rows


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_gives_the_bytes_of_write_rows(triton_kv_quant_write, gen, kv_format, head_dim, dtype):
    writer, device = triton_kv_quant_write
    block_size, num_blocks, num_kv_heads, num_tokens = 16, 5, 2, 9
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    key_pool, value_pool = (random_pool(gen, side, num_blocks, num_kv_heads) for side in (layout.key, layout.value))
    key = with_ties(3 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen), layout.key.bits).to(dtype)
    value = with_ties(torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen), layout.value.bits).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    blocks, offsets = slots // block_size, (slots % block_size).int()
    want_key, want_value = key_pool.clone(), value_pool.clone()
    write_rows(want_key, layout, True, key, blocks, offsets.long())
    write_rows(want_value, layout, False, value, blocks, offsets.long())
    key_pool, value_pool = on(device, key_pool, value_pool)
    writer.write_quantized(key_pool, value_pool, *on(device, key, value, blocks, offsets), kv_format, block_size)
    assert torch.equal(key_pool.cpu(), want_key) and torch.equal(value_pool.cpu(), want_value)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_append_writes_each_sequence_at_its_last_position(triton_kv_quant_write, gen, kv_format):
    writer, device = triton_kv_quant_write
    block_size, head_dim, num_kv_heads = 16, 64, 2
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    key_pool, value_pool = (random_pool(gen, side, 6, num_kv_heads) for side in (layout.key, layout.value))
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([17, 48], dtype=torch.int32)  # slots (1, 0) and (3, 15)
    new_key, new_value = torch.randn(2, num_kv_heads, head_dim, generator=gen), torch.randn(2, num_kv_heads, head_dim,
                                                                                             generator=gen)
    want_key, want_value = key_pool.clone(), value_pool.clone()
    blocks, offsets = torch.tensor([1, 3]), torch.tensor([0, 15])
    write_rows(want_key, layout, True, new_key, blocks, offsets)
    write_rows(want_value, layout, False, new_value, blocks, offsets)
    from engine.attention.decode import new_token_slots

    slot_blocks, slot_offsets = new_token_slots(*on(device, tables, lens), block_size)  # the decode append's slots
    key_pool, value_pool, new_key, new_value = on(device, key_pool, value_pool, new_key, new_value)
    writer.write_quantized(key_pool, value_pool, new_key, new_value, slot_blocks, slot_offsets, kv_format, block_size)
    assert torch.equal(key_pool.cpu(), want_key) and torch.equal(value_pool.cpu(), want_value)


def test_write_refuses_malformed_input(interpreted_kv_quant_write, gen):
    writer = interpreted_kv_quant_write
    layout = kv_quant.layout_for("int8", 64, 16)
    pool = random_pool(gen, layout.key, 2, 1)
    rows, slots = torch.randn(1, 1, 64, generator=gen), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8"):
        writer.write_quantized(pool, pool, rows, rows, slots, slots, "int8", 8)  # unit of another block size
    with pytest.raises(ValueError, match="multiple of 64"):
        writer.write_quantized(pool, pool, rows[..., :32], rows[..., :32], slots, slots, "int8", 16)
    with pytest.raises(ValueError, match="slot_offsets"):
        writer.write_quantized(pool, pool, rows, rows, slots, slots.float(), "int8", 16)


# ---- attention over quantized pools ------------------------------------------------------------
def scattered_tables(gen, context_lens, block_size, num_spare_blocks=3):
    """Each sequence's blocks scattered over a shuffled pool, a stale entry past each table's
    blocks -> (tables [num_seqs, max_blocks + 1] int32, num_blocks)."""
    blocks_per_seq = [max(1, -(-n // block_size)) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.randint(num_blocks, (len(context_lens), max(blocks_per_seq) + 1), generator=gen,
                           dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = pool[start:start + count]
        start += count
    return tables, num_blocks


def quantized_pools(gen, layout, num_blocks, num_kv_heads):
    """Key and value pools with every slot quantized from random rows by the reference writer
    (random bytes would make NaN scales): whatever lies past a context must be ignored."""
    slots = torch.arange(num_blocks * layout.block_size)
    pools = []
    for is_key in (True, False):
        side = layout.side(is_key)
        pool = torch.zeros(num_blocks, num_kv_heads, side.unit_bytes, dtype=torch.uint8)
        rows = torch.randn(len(slots), num_kv_heads, side.head_dim, generator=gen)
        rows += torch.randn(len(slots), num_kv_heads, 1, generator=gen)  # off-centre groups for INT4's min
        write_rows(pool, layout, is_key, rows, slots // layout.block_size, slots % layout.block_size)
        pools.append(pool)
    return pools


def write_rows(pool, layout, is_key, rows, blocks, offsets):
    """The reference writer into one pool of `layout`'s format: its key or value side."""
    side = layout.side(is_key)
    kv_quant.write_rows(kv_quant.unit_views(pool, side, is_key), side, rows, blocks, offsets)


def dequantized(pools, layout):
    """The pools as the 16-bit kernels' fp32 caches: what the reference attends."""
    return (kv_quant.dequantize_pool(pools[0], layout.key, is_key=True),
            kv_quant.dequantize_pool(pools[1], layout.value, is_key=False))


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(2, 1, 64), (1, 4, 128)])
def test_decode_matches_the_reference_over_the_dequantized_pools(triton_paged_decode, gen, kv_format, num_kv_heads,
                                                                 group, head_dim):
    from kernels.cpu import reference

    decode, device = triton_paged_decode
    block_size = 16
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    lens = [1, 37, 2 * block_size]
    tables, num_blocks = scattered_tables(gen, lens, block_size)
    pools = quantized_pools(gen, layout, num_blocks, num_kv_heads)
    query = 3 * torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    got = decode.paged_decode_attention(*on(device, query, *pools, tables, lens), scale, kv_format=kv_format,
                                        block_size=block_size)
    want = reference.paged_decode_attention(query, *dequantized(pools, layout), tables, lens, scale)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_format, block_size, dtype", [
    ("int8", 8, torch.float32),  # a block below tl.dot's tile: broadcast products
    ("int4", 16, torch.bfloat16),  # a half-precision query, output rounded to it
], ids=["int8-small-blocks", "int4-bf16"])
def test_decode_other_blocks_and_dtypes(triton_paged_decode, gen, kv_format, block_size, dtype):
    from kernels.cpu import reference

    decode, device = triton_paged_decode
    layout = kv_quant.layout_for(kv_format, 64, block_size)
    lens = [block_size + 3, 0, 5]  # an empty context gives zeros
    tables, num_blocks = scattered_tables(gen, lens, block_size)
    pools = quantized_pools(gen, layout, num_blocks, 1)
    query = (3 * torch.randn(len(lens), 4, 64, generator=gen)).to(dtype)
    lens = torch.tensor(lens, dtype=torch.int32)
    got = decode.paged_decode_attention(*on(device, query, *pools, tables, lens), 0.125, kv_format=kv_format,
                                        block_size=block_size).cpu()
    want = reference.paged_decode_attention(query.float(), *dequantized(pools, layout), tables, lens, 0.125)
    assert got.dtype == dtype and torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got.float(), want, **tolerance(dtype, device, want, interpreted_eps=2))


def test_decode_refuses_malformed_quantized_input(interpreted_paged_decode, gen):
    decode = interpreted_paged_decode
    layout = kv_quant.layout_for("int4", 64, 16)
    tables, num_blocks = scattered_tables(gen, [5], 16)
    pools = quantized_pools(gen, layout, num_blocks, 1)
    query, lens = torch.randn(1, 2, 64, generator=gen), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        decode.paged_decode_attention(query, *pools, tables, lens, 1.0, kv_format="int4")
    with pytest.raises(ValueError, match=r"uint8 \[num_blocks, kv_heads, 1056\]"):  # INT8's units are larger
        decode.paged_decode_attention(query, *pools, tables, lens, 1.0, kv_format="int8", block_size=16)
    with pytest.raises(ValueError, match="int32"):
        decode.paged_decode_attention(query, *pools, tables.long(), lens, 1.0, kv_format="int4", block_size=16)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_backend_quantizes_the_new_token_in_then_attends(triton_paged_decode, triton_kv_quant_write, gen, kv_format):
    """The backend imports the attention by name, and a CUDA pool's write the quantizing kernel:
    the fixtures' builds of both (on the CPU the pool's write is write_rows')."""
    from engine.attention.decode import DECODE_BACKENDS
    from engine.kv.layouts import create_layout
    from kernels.cpu import reference

    _, device = triton_paged_decode
    block_size, num_kv_heads, head_dim = 16, 2, 64
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    lens = [9, 33]
    tables, num_blocks = scattered_tables(gen, lens, block_size)
    pools = quantized_pools(gen, layout, num_blocks, num_kv_heads)
    query = torch.randn(len(lens), 2 * num_kv_heads, head_dim, generator=gen)
    new_key, new_value = (torch.randn(len(lens), num_kv_heads, head_dim, generator=gen) for _ in range(2))
    lens = torch.tensor(lens, dtype=torch.int32)
    want_pools = [pool.clone() for pool in pools]
    last = lens.long() - 1
    blocks = tables.long().gather(1, (last // block_size)[:, None]).squeeze(1)
    for pool, rows, is_key in ((want_pools[0], new_key, True), (want_pools[1], new_value, False)):
        write_rows(pool, layout, is_key, rows, blocks, last % block_size)
    backend = DECODE_BACKENDS.create("triton", kv_layout=create_layout(kv_format, torch.float32, num_kv_heads,
                                                                        head_dim, block_size))
    want = reference.paged_decode_attention(query, *dequantized(want_pools, layout), tables, lens, 0.125)
    query, tables, lens, new_key, new_value, *pools = on(device, query, tables, lens, new_key, new_value, *pools)
    got = backend.forward(query, *pools, tables, lens, 0.125, new_key, new_value)
    assert torch.equal(pools[0].cpu(), want_pools[0]) and torch.equal(pools[1].cpu(), want_pools[1])
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    assert DECODE_BACKENDS.create("triton").kv_layout is None  # dense by default


def prefill_reference(q, k, v, key_cache, value_cache, block_tables, num_cached, query_start, scale):
    """SDPA over each chunk's own K/V after its prefix gathered from fp32 caches in the 16-bit layout."""
    from engine.attention.prefill import prefill_attention

    block_size, starts = value_cache.shape[2], query_start.tolist()
    prefixes = {}
    for seq, cached in enumerate(num_cached.tolist()):
        positions = torch.arange(cached)
        blocks = block_tables[seq].long()[positions // block_size]
        prefixes[seq] = (key_cache.transpose(-1, -2)[blocks, :, positions % block_size],
                         value_cache[blocks, :, positions % block_size])
    seq_lens = [end - start for start, end in zip(starts, starts[1:])]
    return prefill_attention(q, k, v, seq_lens, scale, prefixes)


def prefill_problem(gen, layout, chunks, num_kv_heads, group, dtype=torch.float32):
    """Chunks (num_cached, query_len) packed together over quantized pools -> (pools, the kernel's
    other arguments)."""
    tables, num_blocks = scattered_tables(gen, [cached + length for cached, length in chunks], layout.block_size)
    pools = quantized_pools(gen, layout, num_blocks, num_kv_heads)
    num_tokens, head_dim = sum(length for _, length in chunks), layout.key.head_dim
    q = 3 * torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    return pools, dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), block_tables=tables,
                       num_cached=torch.tensor([cached for cached, _ in chunks], dtype=torch.int32),
                       query_start=torch.tensor([0] + [length for _, length in chunks]).cumsum(0).to(torch.int32),
                       scale=head_dim ** -0.5)


def prefill_inputs(device, pools, problem) -> dict:
    """The kernel's keywords for prefill_problem's (pools, problem), its tensors on `device`."""
    inputs = dict(problem, key_cache=pools[0], value_cache=pools[1])
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("num_kv_heads, group, head_dim", [(2, 1, 64), (1, 4, 128)])
def test_prefill_over_a_quantized_prefix(triton_paged_prefill, gen, kv_format, num_kv_heads, group, head_dim):
    prefill, device = triton_paged_prefill
    layout = kv_quant.layout_for(kv_format, head_dim, 16)
    chunks = [(0, 19), (37, 5), (32, 24)]  # (num_cached, query_len): no prefix, unaligned, block-aligned
    pools, problem = prefill_problem(gen, layout, chunks, num_kv_heads, group)
    got = prefill.paged_prefill_attention(**prefill_inputs(device, pools, problem), kv_format=kv_format, block_size=16)
    key_cache, value_cache = dequantized(pools, layout)
    want = prefill_reference(key_cache=key_cache, value_cache=value_cache, **problem)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_prefill_in_half_precision(triton_paged_prefill, gen):
    prefill, device = triton_paged_prefill
    layout = kv_quant.layout_for("int4", 64, 16)
    pools, problem = prefill_problem(gen, layout, [(21, 9), (0, 4)], 1, 2, torch.float16)
    got = prefill.paged_prefill_attention(**prefill_inputs(device, pools, problem), kv_format="int4",
                                          block_size=16).cpu()
    upcast = {name: value.float() if value.is_floating_point() else value
              for name, value in problem.items() if isinstance(value, torch.Tensor)}
    key_cache, value_cache = dequantized(pools, layout)
    want = prefill_reference(key_cache=key_cache, value_cache=value_cache, scale=problem["scale"], **upcast)
    assert got.dtype == torch.float16
    # interpreted: 4 eps, the rotated queries and keys are rounded to fp16 once more
    torch.testing.assert_close(got.float(), want, **tolerance(torch.float16, device, want, interpreted_eps=4))


def test_prefill_refuses_malformed_quantized_input(interpreted_paged_prefill, gen):
    prefill = interpreted_paged_prefill
    layout = kv_quant.layout_for("int8", 64, 16)
    pools, problem = prefill_problem(gen, layout, [(5, 3)], 1, 2)
    with pytest.raises(ValueError, match="block_size"):
        prefill.paged_prefill_attention(key_cache=pools[0], value_cache=pools[1], kv_format="int8", **problem)
    with pytest.raises(ValueError, match="the key and value pools"):
        prefill.paged_prefill_attention(key_cache=pools[0], value_cache=pools[1][:-1], kv_format="int8",
                                        block_size=16, **problem)
    with pytest.raises(ValueError, match="int32"):
        prefill.paged_prefill_attention(key_cache=pools[0], value_cache=pools[1], kv_format="int8", block_size=16,
                                        **dict(problem, num_cached=problem["num_cached"].long()))


def test_engine_prefill_wrapper_passes_the_format_on(triton_paged_prefill, gen):
    from engine.attention.prefill import paged_prefill

    prefill, device = triton_paged_prefill
    layout = kv_quant.layout_for("int4", 64, 16)
    inputs = prefill_inputs(device, *prefill_problem(gen, layout, [(0, 6), (19, 4)], 2, 2))
    want = prefill.paged_prefill_attention(**inputs, kv_format="int4", block_size=16)
    table = tuple(inputs["block_tables"][1, :2].tolist())
    got = paged_prefill(prefill, inputs["q"], inputs["k"], inputs["v"], inputs["key_cache"], inputs["value_cache"],
                        [6, 4], [(1, 19, table)], inputs["scale"], kv_format="int4", block_size=16)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
