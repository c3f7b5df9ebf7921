"""Quantized KV caches end to end on the embedded SmolLM2: INT8's and K8V4's greedy tokens against a
16-bit cache's, and quantized blocks through prefix hits, chunks, swaps, demotions and promotions against
a plain engine with the same format. Quantized codes turn a last-bit difference (another batch,
another summation order) into a step of a code, so greedy tokens may part at a near tie: the
checks allow exactly that and no more."""
import pytest

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from offload_costs import write_cost_tables
from test_generation import PROMPTS
from test_prefix_caching import CHUNKED, OTHER, QUESTIONS, SYSTEM, WHOLE, assert_blocks_back

# Where tokens part, the reference's two best tokens were this close (nats). INT8 against a 16-bit
# cache on the parity prompts parted at gaps of 0.014, 0.018 and 0.042 (docs/benchmarks.md). An INT4
# code is a coarse step: the same prompts batched otherwise moved first-token logprobs by up to 0.4.
# K8V4's values are INT4 codes, so INT4's bound (against a 16-bit cache it parted on 6 of the 8
# parity prompts, at gaps up to 0.29; chunked and swapped against whole, at 0.42).
# Where the CPU attends codes by integer dot products (the query in int8, each block's value weights
# in u8), INT4's chunked and swapped run parted from the whole one at a gap of 0.81 (0.6 held with
# fp32 attention on the same run).
NEAR_TIE_NATS = {"int8": 0.1, "int4": 1.0, "k8v4": 0.6}
# Of the 8 parity prompts, how many must give a 16-bit cache's 32 greedy tokens exactly (INT8: half;
# K8V4: the 2 of 8 measured, its 4-bit values moving near ties)
MIN_EQUAL_PROMPTS = {"int8": 4, "k8v4": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


def num_equal_else_near_ties(reference, got, near_tie: float) -> int:
    """How many of `got`'s token lists equal the reference outputs'; asserts the others part from
    them only where the reference's two best tokens were within `near_tie` nats."""
    num_equal = 0
    for want, tokens in zip(reference, got):
        parted = next((i for i, (a, b) in enumerate(zip(want.token_ids, tokens)) if a != b), None)
        if parted is None:
            num_equal += 1
            continue
        (_, best), (_, second) = want.logprobs[parted].top[:2]
        assert best - second < near_tie, f"parted at token {parted}, where the reference was sure by {best - second}"
    return num_equal


@pytest.mark.parametrize("kv", ["int8", "k8v4"])
def test_greedy_tokens_equal_a_16_bit_cache_until_a_near_tie(kv):
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    runs = {}
    for name in ("float16", kv):
        with LLM(dtype="float32", cpu_attention="off", kv_cache_dtype=name) as llm:
            runs[name] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    got = [o.token_ids for o in runs[kv]]
    assert num_equal_else_near_ties(runs["float16"], got, NEAR_TIE_NATS[kv]) >= MIN_EQUAL_PROMPTS[kv]


@pytest.mark.slow  # make test-slow: two engines per format, which make test has no minutes for
@pytest.mark.parametrize("kv", ["int8", "int4", "k8v4"])
def test_quantized_blocks_hit_swap_demote_and_promote(kv, tmp_path):
    prompts = [SYSTEM + q for q in QUESTIONS]
    with LLM(dtype="float32", cpu_attention="off", kv_cache_dtype=kv, **WHOLE) as plain:
        reference = [o.outputs[0] for o in plain.generate(prompts, GREEDY)]
    tables = write_cost_tables(tmp_path, create_loader(EMBEDDED_MODEL).config.num_layers)
    with LLM(dtype="float32", cpu_attention="on", cost_tables=tables, num_blocks=12, num_cpu_blocks=400,
             max_model_len=192, kv_cache_dtype=kv, **CHUNKED) as llm:
        assert llm.engine.runner.kv_cache.cpu.key.dtype.is_floating_point is False  # codes, not elements

        def tokens(batch):
            return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]

        first = tokens(prompts[:1])
        llm.generate([OTHER], GREEDY)  # the first prompt's cached blocks go to the host pool
        again = tokens(prompts[:1])  # found in the host pool, promoted
        together = tokens(prompts)
        scheduler = llm.engine.scheduler
        counters = scheduler.prefix_cache.counters
        assert counters.num_demoted_blocks > 0 and counters.num_promoted_blocks > 0 and counters.hits["cpu"] > 0
        assert scheduler.num_swap_out_blocks > 0 and scheduler.num_swap_in_blocks > 0
        assert_blocks_back(llm)
    assert again == first  # its prefix promoted from the host pool: byte copies of the first run's blocks
    near_tie = NEAR_TIE_NATS[kv]
    num_equal_else_near_ties(reference[:1], first, near_tie)
    num_equal = num_equal_else_near_ties(reference, together, near_tie)
    assert num_equal >= len(reference) // 2 or kv != "int8"  # 4-bit values: most part somewhere, at near ties
