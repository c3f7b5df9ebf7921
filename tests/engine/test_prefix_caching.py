"""Chunked prefill and automatic prefix caching, end to end on the embedded SmolLM2: greedy tokens
with caching on and off, chunked and whole, are the same for shared-prefix prompts, multi-turn
histories, n > 1 samples, preemption, prompt logprobs and (with the host pool) swaps, demotions
and promotions; every block is free or cached afterwards."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.sequence import Tier
from offload_costs import write_cost_tables

SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and never "
          "repeat the question. Keep a friendly tone and prefer plain words over jargon. ") * 3
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?",
             "What do bees make?", "How many legs has a spider?", "What is ice made of?"]
# No prefix in common with SYSTEM, and long enough to take most of a 12-block GPU pool.
OTHER = "Printing presses spread across Europe within fifty years of Gutenberg's first Bible. " * 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Chunks of 40 tokens: every prompt here takes several iterations to prefill.
CHUNKED = dict(max_num_batched_tokens=40, max_num_seqs=8)
WHOLE = dict(max_num_batched_tokens=1024, enable_prefix_caching=False)


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_blocks_back(llm):
    """Every block of every pool is free (cached ones count as free) and none is referenced."""
    scheduler = llm.engine.scheduler
    for pool in (scheduler.block_pool, getattr(scheduler, "cpu_pool", None)):
        if pool is not None:
            assert pool.num_free_blocks == pool.num_blocks
            assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def record_paths(scheduler) -> set[str]:
    """Which two-tier paths the scheduler's plans take from now on (filled in as it plans)."""
    seen, schedule = set(), scheduler.schedule

    def recording_schedule():
        plan = schedule()
        seen.update(name for name, happened in (
            ("swap-out", plan.swap_out), ("swap-in", plan.swap_in),
            ("host-pool chunk after cached tokens",
             any(s.sequence.tier is Tier.CPU and s.num_computed_tokens for s in plan.prefills))) if happened)
        return plan

    scheduler.schedule = recording_schedule
    return seen


@pytest.fixture(scope="module")
def prompts():
    return [SYSTEM + q for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain():
    """The engine as it was: every prompt whole, nothing cached."""
    with LLM(dtype="float32", quantization="none", cpu_attention="off", **WHOLE) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(plain, prompts):
    return token_ids(plain.generate(prompts, GREEDY))


@pytest.fixture(scope="module")
def cached_llm():
    with LLM(dtype="float32", quantization="none", cpu_attention="off", **CHUNKED) as llm:
        yield llm


def test_shared_prefix_prompts_hit_and_give_the_same_tokens(cached_llm, prompts, reference):
    first_outputs = cached_llm.generate(prompts[:1], GREEDY)
    rest_outputs = cached_llm.generate(prompts[1:], GREEDY)  # the system prompt is cached now
    assert token_ids(first_outputs) + token_ids(rest_outputs) == reference
    # each request reports the prompt tokens it found cached: none for the first, whole blocks after
    assert first_outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 3 * 16 and o.num_cached_tokens % 16 == 0 for o in rest_outputs)
    counters = cached_llm.engine.scheduler.prefix_cache.counters
    assert counters.hits["gpu"] >= len(QUESTIONS[1:]) * 3 * 16  # the system prompt's blocks, at least
    assert counters.queries["gpu"] >= sum(len(cached_llm.tokenizer.encode(p)) for p in prompts)
    assert_blocks_back(cached_llm)


def test_multi_turn_history_matches_uncached(cached_llm, plain):
    """Each turn re-sends the conversation so far: its history is a cached prefix."""
    history_cached = history_plain = SYSTEM
    for question in QUESTIONS[:4]:
        history_cached += "\nUser: " + question + "\nAssistant:"
        history_plain += "\nUser: " + question + "\nAssistant:"
        cached = cached_llm.generate([history_cached], GREEDY)[0].outputs[0]
        uncached = plain.generate([history_plain], GREEDY)[0].outputs[0]
        assert cached.token_ids == uncached.token_ids
        history_cached += cached.text
        history_plain += uncached.text
    assert_blocks_back(cached_llm)


def test_n_samples_share_the_prompt_and_sample_alike(cached_llm, plain, prompts):
    params = SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=16)
    hits_before = cached_llm.engine.scheduler.prefix_cache.counters.hits["gpu"]
    prompt = "Tell me a story. " + prompts[2]  # a prompt no earlier test cached
    cached = token_ids(cached_llm.generate([prompt], params))
    # the later samples waited for the first's prompt and took all its full blocks but the last token's
    num_cacheable_tokens = (len(cached_llm.tokenizer.encode(prompt)) - 1) // 16 * 16
    assert cached_llm.engine.scheduler.prefix_cache.counters.hits["gpu"] - hits_before == 2 * num_cacheable_tokens
    assert cached == token_ids(plain.generate([prompt], params))
    assert_blocks_back(cached_llm)


def test_prompt_logprobs_across_chunks_equal_whole(cached_llm, plain, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    whole = plain.generate(prompts[:2], params)
    cached_llm.generate(prompts[:1], GREEDY)  # cached: prompt logprobs must still compute every row
    parts = cached_llm.generate(prompts[:2], params)
    for a, b in zip(whole, parts):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_preemption_with_cached_blocks_gives_the_same_tokens(prompts, reference):
    # 12 blocks of 16 tokens: the shared system prompt and the first blocks of a few questions,
    # which grow into each other
    with LLM(dtype="float32", quantization="none", cpu_attention="off", num_blocks=12, max_model_len=192,
             **CHUNKED) as llm:
        outputs = token_ids(llm.generate(prompts, GREEDY))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_blocks_back(llm)
    assert outputs == reference


def test_host_tier_demotes_promotes_and_swaps_with_the_same_tokens(prompts, reference, tmp_path):
    """A GPU pool of a few prompts' blocks beside a large host pool: cached prefixes the GPU pool
    evicts are demoted, later prompts find them in the host pool (promoted, or decoded there),
    sequences swap both ways; the tokens stay those of the plain engine."""
    tables = write_cost_tables(tmp_path, create_loader(EMBEDDED_MODEL).config.num_layers)
    with LLM(dtype="float32", quantization="none", cpu_attention="on", cost_tables=tables, num_blocks=12,
             num_cpu_blocks=400, max_model_len=192, **CHUNKED) as llm:
        first = token_ids(llm.generate(prompts[:1], GREEDY))
        llm.generate([OTHER], GREEDY)  # fills the GPU pool: the first prompt's cached blocks go to the host pool
        counters = llm.engine.scheduler.prefix_cache.counters
        assert counters.num_demoted_blocks > 0
        again = token_ids(llm.generate(prompts[:1], GREEDY))  # found in the host pool, promoted
        assert counters.num_promoted_blocks > 0 and counters.hits["cpu"] > 0
        seen = record_paths(llm.engine.scheduler)
        outputs_together = token_ids(llm.generate(prompts, GREEDY))
        assert seen == {"swap-out", "swap-in", "host-pool chunk after cached tokens"}
        assert_blocks_back(llm)
    assert first == again == reference[:1] and outputs_together == reference
