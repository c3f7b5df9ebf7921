"""Speculative decoding end to end on the embedded SmolLM2: the same greedy text as without it
(batched, chunked, preempted, cached), the same seeded draws, stop strings, logprobs, n > 1 and
structured outputs, and every block free or cached once the requests end or are aborted."""
import json

import pytest

from engine import LLM, SamplingParams
from engine.model_config import ConfigError
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.structured_output import StructuredOutput

# every decode verifies its drafts (adaptive drafting would verify only those this machine's step
# costs say pay, engine/speculative/budget.py): the tests check what verification gives
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}'
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def fibonacci(n):",
    "List three colors: red, green, blue. List three colors again:",
    "Q: What is 2 + 2?\nA:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,",
]
COPY = ("Copy this text exactly, word for word: the scheduler admits waiting sequences first come first served, "
        "while the token budget and the block pool allow; each takes its cached prefix, then its first chunk.")
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def spec():
    """The embedded model in float32, as the shared `llm` fixture, with n-gram speculation."""
    with LLM("smollm2-135m", dtype="float32", speculative_config=NGRAM) as speculating:
        yield speculating


def test_greedy_text_is_the_text_without_drafts_alone_and_batched(spec, llm):
    prompts = [*PROMPTS, chat_ids(llm, COPY)]
    expected = token_ids(llm.generate(prompts, GREEDY))
    assert token_ids(spec.generate(prompts, GREEDY)) == expected
    assert [token_ids(spec.generate([prompt], GREEDY))[0] for prompt in prompts[:2]] == expected[:2]
    totals = spec.engine.speculator.totals
    assert totals.num_accepted_tokens > 5 and totals.num_draft_tokens >= totals.num_accepted_tokens
    assert totals.num_emitted_tokens > totals.num_accepted_tokens


def test_default_flags_give_the_same_text_one_client_at_a_time():
    """bf16 (or what dtype=auto picks) and the GGUF's packed INT4: a verify row runs the decode
    kernels, so even where rows round differently than fp32 the text does not move."""
    prompts = [COPY, "Write a short poem about the sea."]
    outputs = {}
    for flags in ({}, {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'}):
        with LLM("smollm2-135m", **flags) as default:
            outputs[bool(flags)] = [default.chat([[{"role": "user", "content": p}]], GREEDY)[0].outputs[0].token_ids
                                    for p in prompts]
    assert outputs[True] == outputs[False]


def test_a_tiny_pool_chunks_preempts_and_frees_every_block(llm):
    prompts = PROMPTS * 2
    expected = token_ids(llm.generate(prompts, GREEDY))
    with LLM("smollm2-135m", dtype="float32", num_gpu_blocks=20, max_model_len=160, block_size=16,
             max_num_batched_tokens=32, max_num_seqs=8, speculative_config=NGRAM) as small:
        assert token_ids(small.generate(prompts, GREEDY)) == expected
        scheduler = small.engine.scheduler
        assert scheduler.num_preemptions > 0 and small.engine.speculator.totals.num_accepted_tokens > 0
        assert scheduler.block_pool.num_free_blocks == 20
        assert scheduler.prefix_cache.counters.hits["gpu"] > 0  # the repeated prompts' blocks


def test_seeded_draws_stops_logprobs_and_n_are_as_without_drafts(spec, llm):
    cases = [
        ("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", SamplingParams(temperature=0.8, seed=11, max_tokens=32)),
        ("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", SamplingParams(temperature=0.0, max_tokens=40, stop=[" 5, 1"])),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, n=2)),
        (PROMPTS[2], SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.5, seed=5, max_tokens=24)),
    ]
    for prompt, params in cases:
        want, got = llm.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], params
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
        for mine, theirs in zip(got.outputs, want.outputs):
            for entry, reference in zip(mine.logprobs or [], theirs.logprobs or []):
                assert entry.token_id == reference.token_id
                assert entry.logprob == pytest.approx(reference.logprob, abs=1e-4)


def test_structured_output_rejects_the_drafts_its_grammar_forbids(spec, llm):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured=StructuredOutput("json_schema", json.dumps(schema)))
    prompt = 'Repeat: {"name": "Ada", "age": 36} {"name": "Ada", "age": 36} Now JSON for Ada, 36:'
    got = spec.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == llm.generate(prompt, params)[0].outputs[0].token_ids
    assert set(json.loads(got.text)) == {"name", "age"}


def test_aborts_mid_verification_leave_no_block_held():
    with LLM("smollm2-135m", dtype="float32", num_gpu_blocks=16, max_model_len=128, block_size=16,
             speculative_config=NGRAM) as small:
        engine = small.engine
        ids = [engine.add_request(p, SamplingParams(temperature=0.7 if i % 2 else 0.0, seed=i, max_tokens=60,
                                                    ignore_eos=True)) for i, p in enumerate(PROMPTS * 2)]
        for step in range(300):
            if step in (6, 12):
                engine.abort_request(ids[step // 6])
            engine.step()
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.block_pool.num_free_blocks == 16
        assert engine.speculator.totals.num_drafts > 0


def test_host_pool_sequences_verify_with_cpu_attention(llm, tmp_path):
    """Neo with a GPU pool of one request: drafts of sequences in the host pool are decode rows of
    the CPU's attention, in either sub-batch; the tokens are the GPU-only engine's."""
    from offload_costs import write_cost_tables
    from scheduler.sequence import Tier

    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    prompts = PROMPTS[:4]  # each fits 64 tokens with its 36
    expected = token_ids(llm.generate(prompts, params))
    tables = write_cost_tables(tmp_path, llm.engine.model_config.num_layers)
    with LLM("smollm2-135m", dtype="float32", cpu_attention="on", cost_tables=tables, num_gpu_blocks=16,
             num_cpu_blocks=128, block_size=4, max_model_len=64, max_num_seqs=8, speculative_config=NGRAM) as neo:
        scheduler = neo.engine.scheduler
        verified_tiers = set()
        draft = neo.engine.speculator.draft

        def recording_draft(plan, owner):
            draft(plan, owner)
            verified_tiers.update(share.sequence.tier for share in plan.verifies)

        neo.engine.speculator.draft = recording_draft
        assert token_ids(neo.generate(prompts, params)) == expected
        assert verified_tiers == {Tier.GPU, Tier.CPU}
        assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
        assert scheduler.cpu_pool.num_free_blocks == scheduler.cpu_pool.num_blocks


def test_batch_invariant_text_is_the_same_beside_others_with_drafts():
    """--batch-invariant: a row's numbers do not depend on its batch, so a crowd of requests, some
    verifying drafts, gives each the tokens it gets alone without speculation."""
    prompts = [*PROMPTS, COPY, "Name the planets: Mercury, Venus, Earth, Mars,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    with LLM("smollm2-135m", dtype="bfloat16", batch_invariant=True, max_model_len=512) as plain:
        alone = [token_ids(plain.generate([prompt], params))[0] for prompt in prompts]
    with LLM("smollm2-135m", dtype="bfloat16", batch_invariant=True, max_model_len=512,
             speculative_config=NGRAM) as speculating:
        assert token_ids(speculating.generate(prompts, params)) == alone
        assert speculating.engine.speculator.totals.num_accepted_tokens > 0


DRAFT = '{"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3, "adaptive": false}'


def test_a_draft_model_in_int4_drafts_for_its_own_float32_checkpoint(llm):
    """The embedded model packed in INT4 drafts for itself in float32: most drafts are accepted,
    the text is the target's, seeded draws are too, and its KV pool is whole again once the
    requests end."""
    prompts = [*PROMPTS[:3], chat_ids(llm, "Write a short poem about the sea.")]
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=24)
    with LLM("smollm2-135m", dtype="float32", speculative_config=DRAFT) as drafted:
        assert token_ids(drafted.generate(prompts, GREEDY)) == token_ids(llm.generate(prompts, GREEDY))
        assert token_ids(drafted.generate(prompts[:1], seeded)) == token_ids(llm.generate(prompts[:1], seeded))
        speculator = drafted.engine.speculator
        totals = speculator.totals
        assert totals.num_accepted_tokens > 0.6 * totals.num_draft_tokens > 0
        proposer = speculator.proposer
        fresh = Sequence("fresh", list(range(100, 140)), GREEDY)
        assert proposer.catch_up_tokens(fresh) == 40  # a prompt it has not seen
        assert len(proposer.propose([(fresh, 2)], speculator.proposer_costs)[0]) == 2
        assert proposer.catch_up_tokens(fresh) == 0
        fresh.status = SequenceStatus.FINISHED_ABORTED
        proposer.propose([], speculator.proposer_costs)  # its sweep frees the finished sequences' blocks
        pool = speculator.proposer.pool
        assert pool.num_free_blocks == pool.num_blocks


def test_a_draft_model_with_another_tokenizer_is_refused_at_start():
    other = '{"method": "draft_model", "model": "qwen3-moe-tiny", "load_format": "dummy", "num_speculative_tokens": 2}'
    with pytest.raises(ConfigError, match="must share the target's tokenizer"):
        LLM("smollm2-135m", dtype="float32", speculative_config=other)
