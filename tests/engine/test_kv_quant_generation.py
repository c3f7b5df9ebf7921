"""Quantized KV caches end to end on the embedded SmolLM2: INT8's greedy tokens against a 16-bit
cache's (equal until a near tie), and quantized blocks through prefix hits, chunks, swaps,
demotions and promotions giving the tokens of a plain engine with the same format."""
import pytest

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from offload_costs import write_cost_tables
from test_generation import PROMPTS
from test_prefix_caching import CHUNKED, GREEDY, OTHER, QUESTIONS, SYSTEM, WHOLE, assert_blocks_back, token_ids

# A divergence is a near tie where the 16-bit cache's two best tokens are this close (nats);
# measured on the parity prompts: 0.014, 0.018 and 0.042 (docs/benchmarks.md)
NEAR_TIE_NATS = 0.1


def test_int8_greedy_tokens_equal_a_16_bit_cache_until_a_near_tie():
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    runs = {}
    for kv in ("float16", "int8"):
        with LLM(dtype="float32", cpu_attention="off", kv_cache_dtype=kv) as llm:
            runs[kv] = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    num_equal = 0
    for want, got in zip(runs["float16"], runs["int8"]):
        diverged = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), None)
        if diverged is None:
            num_equal += 1
            continue
        (_, best), (_, second) = want.logprobs[diverged].top[:2]
        assert best - second < NEAR_TIE_NATS, f"diverged at {diverged} where the 16-bit cache was sure"
    assert num_equal >= len(PROMPTS) // 2


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_blocks_hit_swap_demote_and_promote_with_the_same_tokens(kv, tmp_path):
    prompts = [SYSTEM + q for q in QUESTIONS]
    with LLM(dtype="float32", cpu_attention="off", kv_cache_dtype=kv, **WHOLE) as plain:
        reference = token_ids(plain.generate(prompts, GREEDY))
    tables = write_cost_tables(tmp_path, create_loader(EMBEDDED_MODEL).config.num_layers)
    with LLM(dtype="float32", cpu_attention="on", cost_tables=tables, num_blocks=12, num_cpu_blocks=400,
             max_model_len=192, kv_cache_dtype=kv, **CHUNKED) as llm:
        first = token_ids(llm.generate(prompts[:1], GREEDY))
        llm.generate([OTHER], GREEDY)  # the first prompt's cached blocks go to the host pool
        counters = llm.engine.scheduler.prefix_cache.counters
        again = token_ids(llm.generate(prompts[:1], GREEDY))  # found in the host pool, promoted
        together = token_ids(llm.generate(prompts, GREEDY))
        scheduler = llm.engine.scheduler
        assert counters.num_demoted_blocks > 0 and counters.num_promoted_blocks > 0 and counters.hits["cpu"] > 0
        assert scheduler.num_swap_out_blocks > 0 and scheduler.num_swap_in_blocks > 0
        assert_blocks_back(llm)
    # Demoted and promoted blocks are byte copies: the same prompt gives the same tokens. In a
    # batch, another path (CPU attention, other batch sizes) sums in another order, and a last-bit
    # change may cross a code boundary: a near tie can then flip, so most, not all, match.
    assert first == again == reference[:1]
    assert sum(a == b for a, b in zip(together, reference)) >= len(reference) - 2
