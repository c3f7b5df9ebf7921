"""The CPU paged decode-attention kernel against the plain torch reference.

Every case draws fresh random inputs, scatters each sequence over a shuffled
block pool, and poisons the output with NaN first, so an element the kernel
fails to write cannot pass. Instruction-set paths other than the best one are
forced through the `isa` argument, so one machine checks all it can run.
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from kernels import cpu
from kernels.cpu import reference

# max |kernel - reference| / max |reference| of the fp32 result. The reference
# widens the same stored K/V values, so a bf16/fp16 cache does not loosen it.
TOLERANCE = 1e-5
# A bf16/fp16 output is the fp32 result rounded once more: each element may
# also be off by half a unit in its last place (2^-8 relative for bf16, which
# is why an overall 2e-3 bound cannot hold for bf16 outputs).
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUM_CORES = len(os.sched_getaffinity(0))


def usable_isas() -> list[str]:
    return cpu.usable_isas() if cpu.is_available() else ["unbuilt"]


def make_problem(context_lens, *, num_kv_heads=2, group_size=4, head_dim=128, block_size=16,
                 kv_dtype=torch.bfloat16, query_dtype=torch.float32, spare_blocks=7, seed=0):
    """Random query and caches; each sequence's blocks are scattered over a shuffled pool."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 2  # trailing table entries the kernel must ignore
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=generator, dtype=torch.int32)
    block_tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = pool[start:start + count]
        start += count
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    # keys transposed within a block: [num_blocks, num_kv_heads, head_dim, block_size]
    key_cache = torch.randn(shape, generator=generator).to(kv_dtype).transpose(-1, -2).contiguous()
    value_cache = torch.randn(shape, generator=generator).to(kv_dtype)
    # Scaled up so the softmax is peaked, not nearly uniform.
    query = (3 * torch.randn(len(context_lens), num_kv_heads * group_size, head_dim, generator=generator))
    return dict(query=query.to(query_dtype), key_cache=key_cache, value_cache=value_cache,
                block_tables=block_tables, context_lens=torch.tensor(context_lens, dtype=torch.int32),
                scale=1 / math.sqrt(head_dim))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).abs().max() / expected.abs().max()).item()


def check(problem, *, num_threads=None, isa=None, new_kv=None):
    """Runs kernel and reference on copies of the problem and compares them."""
    query = problem["query"]
    out = torch.full_like(query, float("nan"))
    kernel_caches = (problem["key_cache"].clone(), problem["value_cache"].clone())
    reference_caches = (problem["key_cache"].clone(), problem["value_cache"].clone())
    appended = {} if new_kv is None else {"new_key": new_kv[0], "new_value": new_kv[1]}
    cpu.paged_decode_attention(query, *kernel_caches, problem["block_tables"], problem["context_lens"],
                               problem["scale"], out=out, num_threads=num_threads, isa=isa, **appended)
    expected = reference.paged_decode_attention(query.float(), *reference_caches, problem["block_tables"],
                                                problem["context_lens"], problem["scale"], **appended)
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite output elements"
    if query.dtype == torch.float32:
        error = relative_error(out, expected)
        assert error <= TOLERANCE, f"relative error {error:.3g} > {TOLERANCE:.0e}"
    else:
        bound = HALF_ULP[query.dtype] * expected.abs() + TOLERANCE * expected.abs().max()
        excess = ((out.float() - expected).abs() - bound).max().item()
        assert excess <= 0, f"{query.dtype} output off by more than rounding (by {excess:.3g})"
    return kernel_caches, reference_caches


def test_extension_is_built():
    assert cpu.is_available(), f"the CPU attention extension is not built; run `{cpu.BUILD_COMMAND}`"


def test_best_isa_matches_cpu():
    isas = usable_isas()
    assert isas[-1] == "scalar", isas
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512f " in flags and " avx512bw " in flags and " avx512vl " in flags and " avx512dq " in flags:
        assert isas[0] == ("avx512_vnni" if " avx512_vnni " in flags else "avx512")
        assert "avx512" in isas
    elif " avx2 " in flags and " fma " in flags and " f16c " in flags:
        assert isas[0] == "avx2"


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 32])
def test_shapes_and_dtypes(isa, kv_dtype, group_size, head_dim, block_size):
    # Lengths of 1, exact block multiples, one past, and an odd one, in one batch.
    lengths = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 150]
    problem = make_problem(lengths, group_size=group_size, head_dim=head_dim, block_size=block_size,
                           kv_dtype=kv_dtype, seed=group_size * head_dim + block_size)
    check(problem, num_threads=2, isa=isa)


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("num_threads", range(1, NUM_CORES + 2))
def test_long_contexts_over_threads(isa, kv_dtype, num_threads):
    # One long sequence is cut into segments across threads and merged.
    problem = make_problem([4097, 1, 4096, 33], kv_dtype=kv_dtype, seed=num_threads)
    check(problem, num_threads=num_threads, isa=isa)


@pytest.mark.parametrize("num_threads", [1, NUM_CORES, 7])
def test_many_short_sequences(num_threads):
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 400, (100,), generator=generator).tolist()
    check(make_problem(lengths, num_kv_heads=4, seed=2), num_threads=num_threads)


@pytest.mark.parametrize("num_threads", range(2, 10))
def test_cuts_between_kv_heads_of_one_block(num_threads):
    # Work is walked block-major over kv heads, so with 3 kv heads most cuts fall
    # inside a block: some heads of a sequence end whole in one thread, others
    # are partial in two or three.
    problem = make_problem([37, 5, 70], num_kv_heads=3, group_size=2, seed=num_threads)
    check(problem, num_threads=num_threads)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads, group_size", [(2, 4), (3, 2)])
def test_threads_that_run_out_take_work_from_others(kv_dtype, num_kv_heads, group_size):
    # With more threads than cores, some start late or are descheduled; the ones that run out
    # take the back half of their unclaimed units. Each taken range leaves cut segments of its
    # own (inside a block with 3 kv heads), merged with the rest.
    lengths = [4097, 1, 700, 1500, 33, 900]
    stolen = 0
    for seed in range(5):
        problem = make_problem(lengths, num_kv_heads=num_kv_heads, group_size=group_size, kv_dtype=kv_dtype,
                               seed=seed)
        before = cpu.stolen_ranges()
        check(problem, num_threads=4 * NUM_CORES)
        stolen += cpu.stolen_ranges() - before
    assert stolen > 0, "no thread took work from another: this test exercised nothing"


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("num_threads", [2, 3, 4 * NUM_CORES])
def test_whole_sequences_give_the_one_thread_bits_at_any_thread_count(isa, num_threads):
    # Each sequence attended start to end by one thread, nobody taking another's work: nothing to
    # merge, so the rows have exactly the bits of a one-thread call (what the C++ decoder relies
    # on), with no work taken even where threads outnumber the cores.
    lengths = [4097, 1, 700, 1500, 33, 900, 240, 241]
    problem = make_problem(lengths, num_kv_heads=3, group_size=3, seed=num_threads)
    one = cpu.paged_decode_attention(**problem, num_threads=1, isa=isa)
    before = cpu.stolen_ranges()
    many = cpu.paged_decode_attention(**problem, num_threads=num_threads, whole_sequences=True, isa=isa)
    assert cpu.stolen_ranges() == before
    assert torch.equal(one, many)


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 5, 8, 24, 40])
def test_block_sizes_off_the_vector_width(isa, kv_dtype, block_size):
    # Key columns are scored a vector of tokens at a time; a block size that is not a multiple
    # of that span leaves a partial span, scored from a zero-padded copy.
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    problem = make_problem(lengths, group_size=4, block_size=block_size, kv_dtype=kv_dtype, seed=block_size)
    check(problem, num_threads=2, isa=isa)


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_stale_slots_past_the_context_are_ignored(isa, kv_dtype):
    # A block's keys are scored a whole vector of tokens at a time, so slots past the context
    # length are read; whatever they hold (NaN here) must not reach the output. Stale values are
    # large but finite, as the reference multiplies them by a zero probability.
    lengths = [1, 17, 40]
    problem = make_problem(lengths, block_size=16, kv_dtype=kv_dtype, spare_blocks=0, seed=3)
    for i, length in enumerate(lengths):
        last = problem["block_tables"][i, (length - 1) // 16]
        problem["key_cache"][last, :, :, length % 16:] = float("nan")
        problem["value_cache"][last, :, length % 16:] = 1e4
    check(problem, num_threads=2, isa=isa)


def test_one_long_sequence_with_many_threads():
    # More threads than a short sequence has blocks: most get one block or none.
    check(make_problem([50], group_size=8, block_size=16), num_threads=9)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_half_precision_query_and_output(query_dtype, kv_dtype):
    problem = make_problem([1, 17, 700, 2049], kv_dtype=kv_dtype, query_dtype=query_dtype)
    check(problem)


@pytest.mark.parametrize("isa", usable_isas())
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_fused_append(isa, kv_dtype):
    block_size = 16
    lengths = [1, block_size, block_size + 1, 100]
    problem = make_problem(lengths, block_size=block_size, kv_dtype=kv_dtype, seed=5)
    shape = (len(lengths), problem["value_cache"].shape[1], problem["value_cache"].shape[3])
    new_key, new_value = torch.randn(shape).to(kv_dtype), torch.randn(shape).to(kv_dtype)
    (key_cache, value_cache), (ref_key_cache, ref_value_cache) = check(problem, isa=isa,
                                                                       new_kv=(new_key, new_value))
    for i, length in enumerate(lengths):
        block = problem["block_tables"][i, (length - 1) // block_size]
        assert torch.equal(key_cache[block, :, :, (length - 1) % block_size], new_key[i])
        assert torch.equal(value_cache[block, :, (length - 1) % block_size], new_value[i])
    # Nothing else in the caches changed.
    assert torch.equal(key_cache, ref_key_cache)
    assert torch.equal(value_cache, ref_value_cache)


def test_empty_context_gives_zeros():
    problem = make_problem([0, 20])
    out = torch.full_like(problem["query"], float("nan"))
    cpu.paged_decode_attention(**problem, out=out)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1]).all()


def test_returns_new_output_without_out():
    problem = make_problem([40], query_dtype=torch.bfloat16)
    out = cpu.paged_decode_attention(**problem)
    assert out.dtype == torch.bfloat16 and out.shape == problem["query"].shape


def test_concurrent_callers():
    # Reentrant: two Python threads (the GIL is released) share the thread pool. Results are
    # compared with the reference, not bit for bit: how the threads share the work out (and so
    # where sequences are cut and merged) depends on their timing.
    problems = [make_problem([900, 300, 1200], seed=seed) for seed in range(2)]
    expected = [reference.paged_decode_attention(p["query"], p["key_cache"], p["value_cache"], p["block_tables"],
                                                 p["context_lens"], p["scale"]) for p in problems]
    errors = []

    def hammer(index):
        for _ in range(20):
            out = cpu.paged_decode_attention(**problems[index], num_threads=2)
            errors.append(relative_error(out, expected[index]))

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 40 and max(errors) <= TOLERANCE, max(errors)


def test_default_num_threads():
    threads = cpu.default_num_threads()
    assert 1 <= threads <= NUM_CORES
    assert cpu.default_num_threads() == threads  # measured once, cached


def _bad(problem, **changes):
    return {**problem, **changes}


@pytest.mark.parametrize("change, message", [
    (lambda p: _bad(p, block_tables=p["block_tables"].long()), "block_tables dtype"),
    (lambda p: _bad(p, context_lens=p["context_lens"].long()), "context_lens dtype"),
    (lambda p: _bad(p, query=p["query"].transpose(0, 1).contiguous().transpose(0, 1)), "query must be contiguous"),
    (lambda p: _bad(p, query=p["query"].double()), "query dtype"),
    (lambda p: _bad(p, value_cache=p["value_cache"].float()), "value_cache dtype"),
    (lambda p: _bad(p, key_cache=p["value_cache"]), "key_cache must have shape"),
    (lambda p: _bad(p, query=p["query"].to("meta")), "query must be on the CPU, got meta"),
    (lambda p: _bad(p, query=p["query"][:, :, :64].contiguous()), "head_dim"),
    (lambda p: _bad(p, context_lens=p["context_lens"][:1].contiguous()), "context_lens must have shape"),
    (lambda p: _bad(p, context_lens=torch.tensor([10, 10_000], dtype=torch.int32)), "context_lens[1]"),
    (lambda p: _bad(p, block_tables=torch.full_like(p["block_tables"], 10_000)), "outside [0, num_blocks"),
    (lambda p: _bad(p, num_threads=0), "num_threads"),
    (lambda p: _bad(p, isa="sse9"), "isa 'sse9'"),
    (lambda p: _bad(p, new_key=torch.zeros(2, 2, 128)), "new_key and new_value"),
])
def test_rejects_bad_input(change, message):
    problem = make_problem([10, 40])
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        cpu.paged_decode_attention(**change(problem))


def test_rejects_head_dim_not_multiple_of_16():
    problem = make_problem([10], head_dim=72)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 16"):
        cpu.paged_decode_attention(**problem)


def test_rejects_new_key_of_other_dtype():
    problem = make_problem([10], kv_dtype=torch.bfloat16)
    new = torch.zeros(1, 2, 128)
    with pytest.raises(ValueError, match="new_key dtype"):
        cpu.paged_decode_attention(**problem, new_key=new, new_value=new)
