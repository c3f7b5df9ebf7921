"""The Triton paged decode attention (kernels/triton/paged_decode.py) against the torch reference
backend on fresh random inputs, run on CPU tensors by Triton's interpreter and, where a GPU is,
compiled on CUDA tensors (the `triton_paged_decode` fixture of tests/conftest.py): GQA groups,
head dims and block sizes off the tile sizes, ragged contexts over scattered blocks,
half-precision caches, the fused append through the backend, and the errors malformed input gets."""
import math

import pytest
import torch

from engine.attention.decode import TorchPagedDecode
from half_precision import assert_half_close

TOLERANCE = 1e-5


def on(device, *tensors):
    """The test's inputs, made on the CPU, where its kernel runs (the same tensors for cpu)."""
    return tuple(tensor.to(device) for tensor in tensors)


def make_problem(gen, context_lens, num_kv_heads, group, head_dim, block_size, dtype):
    """Random query and caches, each sequence's blocks scattered over a shuffled pool, stale
    values past every context (which must be ignored)."""
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = pool[start:start + count]
        start += count
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache = torch.randn(shape, generator=gen).to(dtype).transpose(-1, -2).contiguous()
    query = (3 * torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def reference(query, key_cache, value_cache, tables, lens, scale):
    """The torch backend's attention, with no new token to append (its append writes the slot's
    current contents back)."""
    last = lens.long() - 1
    blocks = tables.long().gather(1, (last // value_cache.shape[2])[:, None]).squeeze(1)
    offsets = last % value_cache.shape[2]
    new_key = key_cache[blocks, :, :, offsets]
    new_value = value_cache[blocks, :, offsets]
    return TorchPagedDecode().forward(query, key_cache.clone(), value_cache.clone(), tables, lens, scale,
                                      new_key, new_value)


def test_the_kernel_runs_interpreted(interpreted_paged_decode):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(interpreted_paged_decode._paged_decode_kernel, InterpretedFunction)


SHAPES = [  # (num_kv_heads, group, head_dim, block_size)
    (3, 3, 64, 16),  # SmolLM2-135M
    (2, 4, 128, 16),  # Llama-3 style
    (2, 1, 32, 4),  # MHA, a block below tl.dot's tile: its tail masked
    (1, 5, 80, 32),  # head_dim and group off the power-of-two tiles
    (2, 2, 64, 12),  # a block size off the power of two
]


@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", SHAPES)
def test_matches_the_torch_reference(triton_paged_decode, gen, num_kv_heads, group, head_dim, block_size):
    paged, device = triton_paged_decode
    lens = [1, block_size, 3 * block_size + 1, 37]
    problem = make_problem(gen, lens, num_kv_heads, group, head_dim, block_size, torch.float32)
    scale = 1 / math.sqrt(head_dim)
    got = paged.paged_decode_attention(*on(device, *problem), scale)
    torch.testing.assert_close(got.cpu(), reference(*problem, scale), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_caches(triton_paged_decode, gen, dtype):
    paged, device = triton_paged_decode
    query, key_cache, value_cache, tables, lens = make_problem(gen, [5, 40, 17], 2, 4, 64, 16, dtype)
    got = paged.paged_decode_attention(*on(device, query, key_cache, value_cache, tables, lens), 0.125).cpu()
    want = reference(query.float(), key_cache.float(), value_cache.float(), tables, lens, 0.125)
    assert got.dtype == dtype
    assert_half_close(got, want, device, dtype)


def test_empty_context_gives_zeros(triton_paged_decode, gen):
    paged, device = triton_paged_decode
    query, key_cache, value_cache, tables, lens = make_problem(gen, [4, 4], 1, 2, 32, 16, torch.float32)
    lens[1] = 0
    out = paged.paged_decode_attention(*on(device, query, key_cache, value_cache, tables, lens), 0.5).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_backend_appends_the_new_token_first(triton_paged_decode, gen):
    """The backend imports the kernel module by name: the fixture's build of it."""
    from engine.attention.decode import create_decode_backend

    _, device = triton_paged_decode
    query, key_cache, value_cache, tables, lens = make_problem(gen, [9, 16, 30], 2, 2, 64, 16, torch.float32)
    new_key, new_value = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    want_cache = (key_cache.clone(), value_cache.clone())
    want = TorchPagedDecode().forward(query, *want_cache, tables, lens, 0.125, new_key, new_value)
    backend = create_decode_backend("triton", "cuda")
    query, key_cache, value_cache, tables, lens, new_key, new_value = on(
        device, query, key_cache, value_cache, tables, lens, new_key, new_value)
    got = backend.forward(query, key_cache, value_cache, tables, lens, 0.125, new_key, new_value)
    torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)
    assert torch.equal(key_cache.cpu(), want_cache[0]) and torch.equal(value_cache.cpu(), want_cache[1])


def test_malformed_input_is_refused(interpreted_paged_decode, gen):
    paged = interpreted_paged_decode
    query, key_cache, value_cache, tables, lens = make_problem(gen, [4], 1, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="key_cache must be"):
        paged.paged_decode_attention(query, value_cache, value_cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged.paged_decode_attention(query, key_cache, value_cache, tables.long(), lens, 1.0)


def test_auto_picks_it_for_kv_on_cuda():
    from engine.attention.decode import default_decode_backend

    pytest.importorskip("triton")
    assert default_decode_backend("cuda") == "triton" and default_decode_backend("cuda:1") == "triton"
