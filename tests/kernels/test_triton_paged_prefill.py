"""The Triton paged prefill attention (kernels/triton/paged_prefill.py) against a plain torch
reference on fresh random inputs, run on CPU tensors by Triton's interpreter and, where a GPU is,
compiled on CUDA tensors (the `triton_paged_prefill` fixture of tests/conftest.py): ragged chunks
packed together over cached prefixes in scattered blocks (empty and unaligned prefixes, stale
values past every prefix), GQA groups, head dims and block sizes off the tile sizes,
half-precision inputs, and the errors malformed input gets."""
import math

import pytest
import torch

from half_precision import assert_half_close

TOLERANCE = 1e-5


def on(device, problem: dict) -> dict:
    """A problem made on the CPU, its tensors where the kernel runs (the same tensors for cpu)."""
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in problem.items()}


def make_problem(gen, chunks, num_kv_heads, group, head_dim, block_size, dtype=torch.float32):
    """Random chunks (num_cached, query_len) packed together, each sequence's blocks (room for the
    prefix and the chunk) scattered over a shuffled pool. The caches hold random values everywhere:
    past each prefix, the chunk's own slots included, they are stale and must be ignored; table
    entries past the sequence's blocks are stale too."""
    blocks_per_seq = [max(1, math.ceil((cached + length) / block_size)) for cached, length in chunks]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.randint(num_blocks, (len(chunks), max(blocks_per_seq) + 1), generator=gen, dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = pool[start:start + count]
        start += count
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    key_cache = torch.randn(shape, generator=gen).to(dtype).transpose(-1, -2).contiguous()
    query_lens = [length for _, length in chunks]
    num_tokens = sum(query_lens)
    return dict(
        q=(3 * torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)).to(dtype),
        k=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        v=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        key_cache=key_cache, value_cache=value_cache, block_tables=tables,
        num_cached=torch.tensor([cached for cached, _ in chunks], dtype=torch.int32),
        query_start=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        scale=1 / math.sqrt(head_dim))


def gather_prefix(cache_rows, table, num_cached):
    """Positions 0..num_cached-1 of one sequence from a cache in the value layout
    -> [num_cached, kv_heads, head_dim]."""
    block_size = cache_rows.shape[2]
    positions = torch.arange(num_cached)
    return cache_rows[table.long()[positions // block_size], :, positions % block_size]


def reference(q, k, v, key_cache, value_cache, block_tables, num_cached, query_start, scale):
    """Per chunk: the cached prefix gathered from its blocks, the chunk's own k/v after it, an
    explicit softmax in fp64 under a causal mask aligned to the bottom right, GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for seq in range(block_tables.shape[0]):
        start, end, cached = int(query_start[seq]), int(query_start[seq + 1]), int(num_cached[seq])
        keys = torch.cat([gather_prefix(key_cache.transpose(-1, -2), block_tables[seq], cached), k[start:end]])
        values = torch.cat([gather_prefix(value_cache, block_tables[seq], cached), v[start:end]])
        keys = keys.double().repeat_interleave(group, dim=1)  # [num_keys, num_heads, head_dim]
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].double(), keys) * scale
        allowed = torch.ones(end - start, cached + end - start, dtype=torch.bool).tril(diagonal=cached)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def check(triton_paged_prefill, problem, tolerance=TOLERANCE):
    """The kernel on the fixture's device against the reference on the CPU."""
    paged, device = triton_paged_prefill
    got = paged.paged_prefill_attention(**on(device, problem))
    assert got.shape == problem["q"].shape and got.dtype == problem["q"].dtype and got.device.type == device
    torch.testing.assert_close(got.cpu().double(), reference(**problem), atol=tolerance, rtol=tolerance)


def test_the_kernel_runs_interpreted(interpreted_paged_prefill):
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(interpreted_paged_prefill._paged_prefill_kernel, InterpretedFunction)


@pytest.mark.parametrize("num_kv_heads, group, head_dim, block_size", [
    (3, 3, 64, 16),  # SmolLM2-135M: a group off the power of two
    (2, 4, 128, 16),  # Llama-3 style
    (2, 1, 64, 8),  # MHA, blocks smaller than a key tile
    (1, 4, 80, 32),  # head_dim off the power-of-two tile
    (1, 2, 64, 12),  # a block size off the power of two
])
def test_matches_the_torch_reference(triton_paged_prefill, gen, num_kv_heads, group, head_dim, block_size):
    chunks = [(0, 19), (37, 1), (2 * block_size, 24), (5, 40)]  # no prefix, a decode-like row, aligned, unaligned
    check(triton_paged_prefill, make_problem(gen, chunks, num_kv_heads, group, head_dim, block_size))


def test_long_chunks_over_long_prefixes(triton_paged_prefill, gen):
    # many query and key tiles per chunk, an empty chunk packed between
    chunks = [(203, 300), (0, 0), (0, 130), (301, 17)]
    check(triton_paged_prefill, make_problem(gen, chunks, 1, 4, 64, 16))


def test_many_ragged_chunks(triton_paged_prefill, gen):
    # enough chunks, empty ones among them, for several steps of the kernel's search for its chunk
    num_cached = torch.randint(0, 70, (11,), generator=gen).tolist()
    query_lens = torch.randint(0, 40, (11,), generator=gen).tolist()
    query_lens[3] = query_lens[7] = 0
    check(triton_paged_prefill, make_problem(gen, list(zip(num_cached, query_lens)), 2, 2, 64, 16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision(triton_paged_prefill, gen, dtype):
    paged, device = triton_paged_prefill
    problem = make_problem(gen, [(21, 30), (0, 9), (48, 17)], 2, 4, 64, 16, dtype)
    got = paged.paged_prefill_attention(**on(device, problem)).cpu()
    want = reference(**{name: value.float() if isinstance(value, torch.Tensor) and value.is_floating_point()
                        else value for name, value in problem.items()})
    assert got.dtype == dtype
    assert_half_close(got, want, device, dtype)


def test_without_a_prefix_it_is_the_causal_prefill(triton_paged_prefill, gen):
    from engine.attention.prefill import prefill_attention

    paged, device = triton_paged_prefill
    problem = make_problem(gen, [(0, 23), (0, 1), (0, 50)], 2, 3, 64, 16)
    got = paged.paged_prefill_attention(**on(device, problem))
    want = prefill_attention(problem["q"], problem["k"], problem["v"], [23, 1, 50], problem["scale"])
    torch.testing.assert_close(got.cpu(), want, atol=TOLERANCE, rtol=TOLERANCE)


def test_chunk_in_the_cache_or_not_gives_the_same_result(triton_paged_prefill, gen):
    # the chunk's own K/V comes from k and v: writing it into its slots first changes nothing
    paged, device = triton_paged_prefill
    problem = on(device, make_problem(gen, [(13, 20), (40, 7)], 1, 2, 64, 8))
    before = paged.paged_prefill_attention(**problem)
    key_rows, block_size = problem["key_cache"].transpose(-1, -2), problem["value_cache"].shape[2]
    for seq, (cached, start, end) in enumerate(zip(problem["num_cached"].tolist(), problem["query_start"].tolist(),
                                                    problem["query_start"][1:].tolist())):
        positions = torch.arange(cached, cached + end - start, device=device)
        blocks = problem["block_tables"][seq].long()[positions // block_size]
        key_rows[blocks, :, positions % block_size] = problem["k"][start:end]
        problem["value_cache"][blocks, :, positions % block_size] = problem["v"][start:end]
    torch.testing.assert_close(paged.paged_prefill_attention(**problem), before, atol=0, rtol=0)


def test_views_of_a_fused_qkv(triton_paged_prefill, gen):
    # q, k and v sliced out of one projection output keep their row strides
    paged, device = triton_paged_prefill
    problem = on(device, make_problem(gen, [(9, 12), (0, 5)], 2, 2, 64, 16))
    fused = torch.cat([problem["q"], problem["k"], problem["v"]], dim=1)  # [num_tokens, 4 + 2 + 2, head_dim]
    views = dict(problem, q=fused[:, :4], k=fused[:, 4:6], v=fused[:, 6:])
    torch.testing.assert_close(paged.paged_prefill_attention(**views), paged.paged_prefill_attention(**problem),
                               atol=0, rtol=0)


def test_no_tokens_gives_an_empty_output(triton_paged_prefill, gen):
    paged, device = triton_paged_prefill
    problem = make_problem(gen, [(4, 0)], 1, 2, 64, 16)
    assert paged.paged_prefill_attention(**on(device, problem)).shape == (0, 2, 64)


def _swap_caches(p):
    return dict(p, key_cache=p["value_cache"])


@pytest.mark.parametrize("corrupt, message", [
    (_swap_caches, "key_cache must be"),
    (lambda p: dict(p, block_tables=p["block_tables"].long()), "int32"),
    (lambda p: dict(p, query_start=p["query_start"][:-1]), r"query_start \[num_seqs \+ 1\]"),
    (lambda p: dict(p, num_cached=p["num_cached"][:1]), r"num_cached \[num_seqs\]"),
    (lambda p: dict(p, k=p["k"][:-1]), "k and v must be"),
    (lambda p: dict(p, v=p["v"][:, :, :32]), "k and v must be"),
    (lambda p: dict(p, q=p["q"][:, :3]), "does not fit"),
    (lambda p: dict(p, k=p["k"].half()), "share one dtype"),
    (lambda p: dict(p, key_cache=p["key_cache"].double(), value_cache=p["value_cache"].double()), "fp32, bf16"),
    (lambda p: dict(p, q=p["q"][0]), r"\[num_tokens, heads, head_dim\]"),
], ids=["caches-swapped", "int64-tables", "short-query-start", "short-num-cached", "k-rows", "v-head-dim",
        "q-heads", "kv-dtype", "cache-dtype", "q-2d"])
def test_malformed_input_is_refused(interpreted_paged_prefill, gen, corrupt, message):
    problem = make_problem(gen, [(4, 3), (0, 2)], 2, 2, 64, 16)
    with pytest.raises(ValueError, match=message):
        interpreted_paged_prefill.paged_prefill_attention(**corrupt(problem))


def test_engine_wrapper_matches_the_gathered_sdpa_path(triton_paged_prefill, gen):
    """engine/attention/prefill.py's `paged_prefill` (the CUDA path of LlamaModel's prefill
    attention) against its gather + SDPA path over a real KV pool: a whole prompt, a chunk after
    an unaligned prefix and one after a block-aligned prefix, packed in one batch."""
    from engine.attention.prefill import paged_prefill, prefill_attention
    paged, device = triton_paged_prefill
    problem = make_problem(gen, [(0, 7), (5, 6), (8, 3)], num_kv_heads=2, group=2, head_dim=16, block_size=4)
    seq_lens = [7, 6, 3]
    prefixes = [(index, int(problem["num_cached"][index]), tuple(problem["block_tables"][index].tolist()))
                for index in (1, 2)]
    q, k, v = problem["q"], problem["k"], problem["v"]
    key_cache, value_cache = problem["key_cache"], problem["value_cache"]
    moved = on(device, problem)
    out = paged_prefill(paged, moved["q"], moved["k"], moved["v"], moved["key_cache"], moved["value_cache"], seq_lens,
                        prefixes, problem["scale"])
    key_rows = key_cache.transpose(-1, -2)
    gathered = {index: (gather_prefix(key_rows, torch.tensor(table), cached),
                        gather_prefix(value_cache, torch.tensor(table), cached)) for index, cached, table in prefixes}
    expected = prefill_attention(q, k, v, seq_lens, problem["scale"], gathered)
    torch.testing.assert_close(out.cpu(), expected, atol=TOLERANCE, rtol=TOLERANCE)
