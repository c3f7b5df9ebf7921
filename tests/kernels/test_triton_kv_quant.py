"""Triton kernels over group-quantized KV pools (kernels/kv_quant.py's layout) against its plain
torch reference, on CPU tensors under Triton's interpreter (tests/conftest.py): the quantizing
slot write byte for byte against `write_rows` (round-half-even ties, zero-range groups, bf16
rows), and paged attention reading the codes against the 16-bit reference over
`dequantize_pool`'s copy of the same pools."""
import pytest
import torch

from kernels import kv_quant

FORMATS = ["int8", "int4"]


@pytest.fixture
def writer(interpreted_kv_quant_write):
    return interpreted_kv_quant_write


def random_pool(gen, layout, num_blocks, num_kv_heads):
    """Random bytes everywhere: the slots not written must keep theirs."""
    return torch.randint(0, 256, (num_blocks, num_kv_heads, layout.unit_bytes), generator=gen, dtype=torch.uint8)


def with_ties(rows, kv_format):
    """Rows whose first groups quantize with scale exactly 1, so that x / scale lands on .5 ties
    (round half to even tells them apart), and one group of zero range."""
    ties = torch.arange(-7, 8).float() + 0.5  # -6.5 .. 7.5
    if kv_format == "int8":
        group = torch.cat([torch.tensor([127.0]), ties.repeat(5)[:63]])
    else:
        group = torch.cat([torch.tensor([0.0, 15.0]), (ties + 7).repeat(5)[:62]])
    rows[0, 0, :kv_quant.GROUP_SIZE] = group
    rows[-1, -1, -kv_quant.GROUP_SIZE:] = 0.0 if kv_format == "int8" else 0.25  # zero range: scale 0, codes 0
    return rows


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_gives_the_bytes_of_write_rows(writer, gen, kv_format, head_dim, dtype):
    block_size, num_blocks, num_kv_heads, num_tokens = 16, 5, 2, 9
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    key_pool, value_pool = random_pool(gen, layout, num_blocks, num_kv_heads), random_pool(gen, layout, num_blocks,
                                                                                            num_kv_heads)
    key = with_ties(3 * torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen), kv_format).to(dtype)
    value = with_ties(torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen), kv_format).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    blocks, offsets = slots // block_size, (slots % block_size).int()
    want_key, want_value = key_pool.clone(), value_pool.clone()
    kv_quant.write_rows(kv_quant.unit_views(want_key, layout, True), layout, key, blocks, offsets.long())
    kv_quant.write_rows(kv_quant.unit_views(want_value, layout, False), layout, value, blocks, offsets.long())
    writer.write_quantized(key_pool, value_pool, key, value, blocks, offsets, kv_format, block_size)
    assert torch.equal(key_pool, want_key) and torch.equal(value_pool, want_value)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_append_writes_each_sequence_at_its_last_position(writer, gen, kv_format):
    block_size, head_dim, num_kv_heads = 16, 64, 2
    layout = kv_quant.layout_for(kv_format, head_dim, block_size)
    key_pool, value_pool = random_pool(gen, layout, 6, num_kv_heads), random_pool(gen, layout, 6, num_kv_heads)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([17, 48], dtype=torch.int32)  # slots (1, 0) and (3, 15)
    new_key, new_value = torch.randn(2, num_kv_heads, head_dim, generator=gen), torch.randn(2, num_kv_heads, head_dim,
                                                                                             generator=gen)
    want_key, want_value = key_pool.clone(), value_pool.clone()
    blocks, offsets = torch.tensor([1, 3]), torch.tensor([0, 15])
    kv_quant.write_rows(kv_quant.unit_views(want_key, layout, True), layout, new_key, blocks, offsets)
    kv_quant.write_rows(kv_quant.unit_views(want_value, layout, False), layout, new_value, blocks, offsets)
    writer.append_quantized(key_pool, value_pool, tables, lens, new_key, new_value, kv_format, block_size)
    assert torch.equal(key_pool, want_key) and torch.equal(value_pool, want_value)


def test_write_refuses_malformed_input(writer, gen):
    layout = kv_quant.layout_for("int8", 64, 16)
    pool = random_pool(gen, layout, 2, 1)
    rows, slots = torch.randn(1, 1, 64, generator=gen), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="uint8"):
        writer.write_quantized(pool, pool, rows, rows, slots, slots, "int8", 8)  # unit of another block size
    with pytest.raises(ValueError, match="multiple of 64"):
        writer.write_quantized(pool, pool, rows[..., :32], rows[..., :32], slots, slots, "int8", 16)
    with pytest.raises(ValueError, match="slot_offsets"):
        writer.write_quantized(pool, pool, rows, rows, slots, slots.float(), "int8", 16)
