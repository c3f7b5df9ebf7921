"""The CPU paged decode attention over group-quantized KV pools (INT8, INT4, K8V4) against the plain
reference: kernels.kv_quant.dequantize_pool's fp32 caches fed to kernels.cpu.reference. Both see
the same dequantized values, so only fp32 summation order separates them.

Pools are filled by kv_quant.write_rows from fresh random rows (every slot, so stale slots hold
finite values the reference can multiply by a zero probability); each sequence's blocks are
scattered over a shuffled pool. The fused append must write the very bytes write_rows writes.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels import cpu, kv_quant
from kernels.cpu import reference

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")

ISAS = cpu.usable_isas() if cpu.is_available() else []
FORMATS = sorted(kv_quant.FORMAT_CODES)
# max |kernel - reference| / max |reference| of an fp32 result
TOLERANCE = 1e-4
# The same where integer dot products round the query to int8 and each block's value weights to u8
# (reference.dotted_decode_attention is their spec, held to TOLERANCE below). These tests' peaked
# queries over off-centre value groups, whose output is a small difference of large values, move by
# up to 3.5% of the largest; on the embedded model's own KV the whole path costs +0.1% perplexity
# (docs/benchmarks.md).
DOTS_TOLERANCE = 5e-2
# A bf16/fp16 output is the fp32 result rounded once more: half a unit in its last place.
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def fill_pool(fmt: str, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int, is_key: bool,
              gen: torch.Generator) -> torch.Tensor:
    """A layer's pool [num_blocks, num_kv_heads, unit_bytes] with every slot quantized from random rows."""
    layout = kv_quant.layout_for(fmt, head_dim, block_size).side(is_key)
    pool = torch.zeros(num_blocks, num_kv_heads, layout.unit_bytes, dtype=torch.uint8)
    rows = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    rows += torch.randn(num_blocks * block_size, num_kv_heads, head_dim // kv_quant.GROUP_SIZE, 1,
                        generator=gen).repeat_interleave(kv_quant.GROUP_SIZE, -1).flatten(-2)  # off-centre groups
    blocks = torch.arange(num_blocks).repeat_interleave(block_size)
    offsets = torch.arange(block_size).repeat(num_blocks)
    kv_quant.write_rows(kv_quant.unit_views(pool, layout, is_key), layout, rows, blocks, offsets)
    return pool


def make_problem(context_lens, fmt, gen, *, num_kv_heads=2, group_size=4, head_dim=128, block_size=16,
                 query_dtype=torch.float32, spare_blocks=3):
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen, dtype=torch.int32)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = pool[start:start + count]
        start += count
    caches = [fill_pool(fmt, num_blocks, num_kv_heads, head_dim, block_size, is_key, gen) for is_key in (True, False)]
    query = 3 * torch.randn(len(context_lens), num_kv_heads * group_size, head_dim, generator=gen)
    return dict(query=query.to(query_dtype), key_cache=caches[0], value_cache=caches[1], block_tables=block_tables,
                context_lens=torch.tensor(context_lens, dtype=torch.int32), scale=1 / math.sqrt(head_dim),
                kv_format=fmt, block_size=block_size)


def integer_dots(isa: str | None) -> bool:
    """Whether the kernel `isa` names (None: the best usable) scores keys with an int8 query."""
    return (isa or ISAS[0]) in cpu.integer_dot_isas()


def reference_attention(problem, key_cache, value_cache) -> torch.Tensor:
    layout = kv_quant.layout_for(problem["kv_format"], problem["query"].shape[-1], problem["block_size"])
    return reference.paged_decode_attention(problem["query"].float(),
                                            kv_quant.dequantize_pool(key_cache, layout.key, True),
                                            kv_quant.dequantize_pool(value_cache, layout.value, False),
                                            problem["block_tables"], problem["context_lens"], problem["scale"])


def append_reference(problem, key_cache, value_cache, new_key, new_value) -> None:
    """kv_quant.write_rows of the new rows at each sequence's position context_len - 1."""
    layout = kv_quant.layout_for(problem["kv_format"], problem["query"].shape[-1], problem["block_size"])
    positions = problem["context_lens"].long() - 1
    blocks = problem["block_tables"][torch.arange(len(positions)), positions // layout.block_size].long()
    offsets = positions % layout.block_size
    for pool, rows, is_key in ((key_cache, new_key, True), (value_cache, new_value, False)):
        side = layout.side(is_key)
        kv_quant.write_rows(kv_quant.unit_views(pool, side, is_key), side, rows, blocks, offsets)


def assert_close(out: torch.Tensor, expected: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite output elements"
    if out.dtype == torch.float32:
        error = ((out - expected).abs().max() / expected.abs().max()).item()
        assert error <= tolerance, f"relative error {error:.3g} > {tolerance:.0e}"
    else:
        bound = HALF_ULP[out.dtype] * expected.abs() + tolerance * expected.abs().max()
        excess = ((out.float() - expected).abs() - bound).max().item()
        assert excess <= 0, f"{out.dtype} output off by more than rounding (by {excess:.3g})"


def check(problem, *, num_threads=2, isa=None, new_kv=None, kernel_caches=None):
    """Kernel and reference on copies of the problem's pools; returns both pairs of pools."""
    kernel_caches = kernel_caches or (problem["key_cache"].clone(), problem["value_cache"].clone())
    reference_caches = (problem["key_cache"].clone(), problem["value_cache"].clone())
    appended = {}
    if new_kv is not None:
        appended = {"new_key": new_kv[0], "new_value": new_kv[1]}
        append_reference(problem, *reference_caches, *new_kv)
    out = torch.full_like(problem["query"], float("nan"))
    cpu.paged_decode_attention(**{**problem, "key_cache": kernel_caches[0], "value_cache": kernel_caches[1]}, out=out,
                               num_threads=num_threads, isa=isa, **appended)
    assert_close(out, reference_attention(problem, *reference_caches),
                 DOTS_TOLERANCE if integer_dots(isa) else TOLERANCE)
    return kernel_caches, reference_caches


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_shapes(isa, fmt, group_size, head_dim, block_size, gen):
    # Lengths of 1, a whole block, one past, and ones that end inside a block, in one batch.
    lengths = [1, block_size, block_size + 1, 3 * block_size - 5, 75]
    problem = make_problem(lengths, fmt, gen, group_size=group_size, head_dim=head_dim, block_size=block_size)
    check(problem, isa=isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_contexts_over_threads(isa, fmt, num_threads, query_dtype, gen):
    # With two threads the long sequence is cut into segments whose partial states are merged.
    problem = make_problem([1030, 1, 333], fmt, gen, num_kv_heads=3, group_size=4, query_dtype=query_dtype)
    check(problem, num_threads=num_threads, isa=isa)




@pytest.mark.parametrize("isa", [isa for isa in ISAS if integer_dots(isa)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_integer_dots_follow_their_spec(isa, fmt, block_size, gen):
    """One thread over whole sequences gives reference.dotted_decode_attention: the int8 query, the
    online softmax block by block, and each block's value weights rounded to u8."""
    problem = make_problem([1, 15, 16, 47, 130], fmt, gen, block_size=block_size)
    out = cpu.paged_decode_attention(**problem, num_threads=1, isa=isa)
    layout = kv_quant.layout_for(fmt, problem["query"].shape[-1], block_size)
    expected = reference.dotted_decode_attention(problem["query"], problem["key_cache"], problem["value_cache"],
                                                 problem["block_tables"], problem["context_lens"], problem["scale"],
                                                 layout)
    assert_close(out, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_that_run_out_take_work_from_others(fmt, gen):
    # More threads than cores: some start late, and the first to run out take the back half of
    # another's range (units are small here, so it takes long sequences to leave enough).
    lengths = [8193, 1, 1500, 33, 4000, 900]
    stolen = 0
    for _ in range(3):
        problem = make_problem(lengths, fmt, gen, num_kv_heads=3, group_size=2)
        before = cpu.stolen_ranges()
        check(problem, num_threads=16)
        stolen += cpu.stolen_ranges() - before
    assert stolen > 0, "no thread took work from another: this test exercised nothing"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_sequences_give_the_one_thread_bits(isa, fmt, gen):
    problem = make_problem([700, 1, 240, 241], fmt, gen, num_kv_heads=2, group_size=3)
    one = cpu.paged_decode_attention(**problem, num_threads=1, isa=isa)
    many = cpu.paged_decode_attention(**problem, num_threads=3, whole_sequences=True, isa=isa)
    assert torch.equal(one, many)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_stale_slots_past_the_context_are_ignored(isa, fmt, gen):
    # Scores are taken a vector of tokens at a time, so slots past the context are read; their
    # scales and mins (NaN here) must not reach the output.
    lengths = [1, 17, 40]
    problem = make_problem(lengths, fmt, gen, spare_blocks=0)
    layout = kv_quant.layout_for(fmt, 128, 16)
    caches = (problem["key_cache"].clone(), problem["value_cache"].clone())
    for pool, is_key in zip(caches, (True, False)):
        views = kv_quant.unit_views(pool, layout.side(is_key), is_key)
        for i, length in enumerate(lengths):
            last = problem["block_tables"][i, (length - 1) // 16]
            views.scales[last, :, :, length % 16:] = float("nan")
            if views.mins is not None:
                views.mins[last, :, :, length % 16:] = float("nan")
    check(problem, isa=isa, kernel_caches=caches)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_append_writes_the_bytes_of_write_rows(isa, fmt, query_dtype, gen):
    lengths = [1, 16, 17, 100]
    problem = make_problem(lengths, fmt, gen, num_kv_heads=3, query_dtype=query_dtype)
    shape = (len(lengths), 3, 128)
    new_key = (torch.randn(shape, generator=gen) * 2 + 1).to(query_dtype)
    new_value = torch.randn(shape, generator=gen).to(query_dtype)
    kernel, expected = check(problem, isa=isa, new_kv=(new_key, new_value))
    assert torch.equal(kernel[0], expected[0]) and torch.equal(kernel[1], expected[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_append_rounds_edge_rows_as_write_rows(fmt, gen):
    # Rows whose groups have ties at half a code (rounded to even), zero range (codes 0), values
    # so small that the fp16 scale is subnormal or zero, and a constant offset.
    head_dim = 4 * kv_quant.GROUP_SIZE
    ramp = torch.arange(kv_quant.GROUP_SIZE, dtype=torch.float32)
    ties = torch.cat([ramp[:-2] % 15 + 0.5, torch.tensor([0.0, 127.0 if fmt != "int4" else 15.0])])
    groups = [ties, torch.zeros(kv_quant.GROUP_SIZE), 1e-6 * torch.randn(kv_quant.GROUP_SIZE, generator=gen),
              torch.full((kv_quant.GROUP_SIZE,), 3.0)]
    row = torch.cat(groups)
    problem = make_problem([5, 40], fmt, gen, num_kv_heads=1, group_size=1, head_dim=head_dim)
    new_key = torch.stack([row, -row])[:, None, :]
    new_value = torch.stack([row.flip(0), 1e-5 * row])[:, None, :]
    kernel, expected = check(problem, new_kv=(new_key, new_value))
    assert torch.equal(kernel[0], expected[0]) and torch.equal(kernel[1], expected[1])


def _bad(problem, **changes):
    return {**problem, **changes}


@pytest.mark.parametrize("change, message", [
    (lambda p: _bad(p, kv_format="int3"), "unknown quantized KV format"),
    (lambda p: _bad(p, block_size=None), "needs block_size"),
    (lambda p: _bad(p, block_size=8), "block_size a multiple of 16"),
    (lambda p: _bad(p, block_size=32), "holds 4224 bytes"),
    (lambda p: _bad(p, query=p["query"][:, :, :96].contiguous()), "head_dim a multiple of 64"),
    (lambda p: _bad(p, key_cache=p["key_cache"].float()), "key_cache dtype"),
    (lambda p: _bad(p, value_cache=p["value_cache"][:1].contiguous()), "value_cache must have shape"),
    (lambda p: _bad(p, new_key=torch.zeros(2, 2, 128, dtype=torch.bfloat16),
                    new_value=torch.zeros(2, 2, 128, dtype=torch.bfloat16)), "new_key dtype"),
])
def test_rejects_bad_input(change, message, gen):
    problem = make_problem([10, 40], "int8", gen)
    with pytest.raises(ValueError, match=message):
        cpu.paged_decode_attention(**change(problem))


def test_k8v4_refuses_int8_value_units(gen):
    # int8 pools look like k8v4's keys; the values must be INT4 units (1152 bytes at head_dim 128)
    problem = make_problem([10, 40], "int8", gen)
    with pytest.raises(ValueError, match="value unit .* holds 1152 bytes"):
        cpu.paged_decode_attention(**{**problem, "kv_format": "k8v4"})


def test_the_extension_refuses_a_block_size_off_the_scale_vectors(gen):
    # The C++ entry checks on its own what the wrapper checks (the C++ decoder calls it directly).
    problem = make_problem([10], "int4", gen, num_kv_heads=1, group_size=1, head_dim=64)
    query, out = problem["query"], torch.empty_like(problem["query"])
    with pytest.raises(ValueError, match="block_size a multiple of 16"):
        cpu._extension().paged_decode_attention(
            query.data_ptr(), out.data_ptr(), 0, problem["key_cache"].data_ptr(), problem["value_cache"].data_ptr(),
            kv_quant.FORMAT_CODES["int4"], problem["key_cache"].shape[0], problem["block_tables"].data_ptr(),
            problem["context_lens"].data_ptr(), 1, problem["block_tables"].shape[1], 1, 1, 64, 8, 1.0, 0, 0, 1,
            False, "")
