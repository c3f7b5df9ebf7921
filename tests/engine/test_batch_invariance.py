"""--batch-invariant: a token's numbers do not depend on what it is computed with. The kernels give a
row the same bits at any row count (INT4 x as int16, the dense GEMV, attention row by row), and the
embedded model in bf16 gives the same greedy text with prefix caching on and off, chunked and whole,
alone and beside 31 other requests, on a multi-turn chat over held text."""
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.prefill import prefill_attention, rowwise_prefill
from engine.config import ConfigError, EngineConfig, Int4Prefill
from engine.quant import create_linear_method
from kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(), reason="the CPU kernels are not built")

HELD_TEXT = Path(__file__).resolve().parents[1] / "data" / "held_text.txt"
QUESTIONS = ["Who is Mr. Bingley?", "What does Mrs. Bennet want?", "Describe Elizabeth."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.parametrize("method, options", [("int4", {"prefill": Int4Prefill.INT16}),
                                             ("dense", {"row_invariant": True})])
def test_a_rows_bits_do_not_depend_on_the_row_count(method, options):
    gen = torch.Generator().manual_seed(3)
    weight = create_linear_method(method, **options).create_weight(
        torch.randn(96, 256, generator=gen), None, dtype=torch.bfloat16, device=torch.device("cpu"))
    x = torch.randn(150, 256, generator=gen).to(torch.bfloat16)
    together = weight.apply(x)
    for start, stop in ((0, 1), (7, 10), (20, 150), (149, 150)):
        assert torch.equal(weight.apply(x[start:stop]), together[start:stop])


def test_rowwise_prefill_gives_each_row_its_decodes_bits():
    """Two prompts in one batch, the second after a cached prefix that ends inside a block: each row
    equals the decode kernel's answer at its position, and SDPA's within rounding."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, kv_heads, heads, head_dim = 12, 16, 2, 6, 64
    key_pool = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
    value_pool = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=gen)
    seq_lens, cached, cached_blocks = [20, 13], 21, (4, 9)  # second prompt: positions 21..33
    tables = [[1, 7], [4, 9, 2]]
    slot_blocks = torch.tensor([tables[0][p // block_size] for p in range(20)]
                               + [tables[1][p // block_size] for p in range(cached, cached + 13)])
    q = torch.randn(sum(seq_lens), heads, head_dim, generator=gen)
    out = rowwise_prefill(cpu_kernels.paged_decode_attention, q, key_pool, value_pool, seq_lens,
                          {1: (cached, cached_blocks)}, slot_blocks, block_size, 0.125)
    positions = [*range(20), *range(cached, cached + 13)]
    for row, position in enumerate(positions):
        table = torch.tensor([tables[0 if row < 20 else 1]], dtype=torch.int32)
        decode = cpu_kernels.paged_decode_attention(q[row:row + 1], key_pool, value_pool, table,
                                                    torch.tensor([position + 1], dtype=torch.int32), 0.125,
                                                    num_threads=1)
        assert torch.equal(out[row], decode[0]), row

    def rows(pool_rows, table, count):  # [count, kv_heads, head_dim] from a sequence's blocks
        return torch.cat([pool_rows[block] for block in table])[:count]
    keys = [rows(key_pool.transpose(-1, -2).transpose(1, 2), t, n) for t, n in ((tables[0], 20), (tables[1], 34))]
    values = [rows(value_pool.transpose(1, 2), t, n) for t, n in ((tables[0], 20), (tables[1], 34))]
    want = prefill_attention(q, torch.cat([keys[0], keys[1][cached:]]), torch.cat([values[0], values[1][cached:]]),
                             seq_lens, 0.125, {1: (keys[1][:cached], values[1][:cached])})
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (dict(device="testbed"), "batch_invariant runs on device cpu"),
    (dict(int4_prefill="int8"), "drop --int4-prefill int8"),
    (dict(cpu_attention="on"), "drop --cpu-attention on"),
])
def test_what_batch_invariance_cannot_hold_is_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_flat(batch_invariant=True, **flags)


def chat(llm, system: str) -> list[list[int]]:
    """Each question in turn over the conversation so far; the greedy reply's tokens per turn."""
    messages, replies = [{"role": "system", "content": system}], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        reply = llm.chat([messages], GREEDY)[0].outputs[0]
        messages.append({"role": "assistant", "content": reply.text})
        replies.append(reply.token_ids)
    return replies


@pytest.fixture(scope="module")
def system_prompt() -> str:
    return "Answer from this text.\n" + HELD_TEXT.read_text()[:2400]


def invariant_llm(**flags) -> LLM:
    return LLM(dtype="bfloat16", batch_invariant=True, max_model_len=2048, **flags)


# make test-slow: a group-quantized pool (the decode kernel reads it for the prompt rows too)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_greedy_chat_is_the_same_cached_or_not_chunked_or_not_alone_or_in_a_crowd(system_prompt, kv_cache_dtype):
    with invariant_llm(prefix_caching=False, max_num_batched_tokens=48, max_num_seqs=8,
                       kv_cache_dtype=kv_cache_dtype) as llm:
        chunked_uncached = chat(llm, system_prompt)
    with invariant_llm(prefix_caching=True, kv_cache_dtype=kv_cache_dtype) as llm:
        assert chat(llm, system_prompt) == chunked_uncached
        assert llm.engine.scheduler.prefix_cache.counters.hits["gpu"] > 0
        text = HELD_TEXT.read_text()
        crowd = [text[400 * i:400 * i + 200 + 20 * i] for i in range(1, 32)]
        short = SamplingParams(temperature=0.0, max_tokens=8)
        alone = llm.generate(crowd[:1], short)[0].outputs[0].token_ids
        together = llm.generate([*crowd, crowd[0]], short)
        assert together[0].outputs[0].token_ids == alone == together[-1].outputs[0].token_ids
