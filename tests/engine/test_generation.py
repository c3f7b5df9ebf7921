"""End to end on the embedded SmolLM2: greedy tokens against Hugging Face transformers,
preemption under a tiny block pool, seeded sampling, stop strings, aborts and block accounting."""
import os

import pytest
import torch

from scheduler.planning.kv_format import kv_format
from engine import LLM, ParamError, SamplingParams
from engine.config import ACTIVATION_RESERVE_GIB
from engine.model_config import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three colors:",
    "Water boils at",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "In 1492, Columbus sailed across the Atlantic Ocean and reached the islands now known as the",
    "Q: What is 2 + 2?\nA:",
]
NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


# `llm`: the embedded model as served by default, in float32 (tests/conftest.py, shared with the
# server tests' offline references)
@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


EOS_ID = 2


@pytest.fixture(scope="module")
def hf_greedy(prompt_ids, embedded_hf_model):
    """transformers' greedy tokens, the prompts in one left-padded batch (5x faster than one by one;
    in float32 the padded rows gave the same tokens as each prompt alone)."""
    width = max(map(len, prompt_ids))
    padded = torch.tensor([[EOS_ID] * (width - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    with torch.inference_mode():
        out = embedded_hf_model.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                                         eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return [until_eos(row[width:].tolist()) for row in out]


def until_eos(tokens: list[int]) -> list[int]:
    """A finished row's tokens through its end of sequence (the batch pads the rest with it)."""
    return tokens[:tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_alone_and_batched(llm, prompt_ids, hf_greedy):
    alone = [token_ids(llm.generate([ids], GREEDY))[0] for ids in prompt_ids]
    assert alone == hf_greedy
    assert token_ids(llm.generate(prompt_ids, GREEDY)) == hf_greedy


def test_tiny_block_pool_preempts_and_gives_the_same_tokens(prompt_ids, hf_greedy):
    small = LLM("smollm2-135m", dtype="float32", num_blocks=20, max_model_len=160, block_size=16)
    outputs = small.generate(prompt_ids, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == hf_greedy
    assert small.engine.scheduler.block_pool.num_free_blocks == 20


def test_seeded_sampling_is_reproducible_across_batches(llm, prompt_ids):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    alone = token_ids(llm.generate([prompt_ids[0]], seeded))[0]
    again = token_ids(llm.generate([prompt_ids[0]], seeded))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=30), SamplingParams(temperature=0.5, seed=7, max_tokens=10)]
    mixed = llm.generate([prompt_ids[3], prompt_ids[1], prompt_ids[0], prompt_ids[2]],
                         [others[0], others[1], seeded, others[0]])
    assert alone == again == mixed[2].outputs[0].token_ids
    other_seed = token_ids(llm.generate([prompt_ids[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                                         max_tokens=24)))[0]
    assert other_seed != alone


def test_stop_strings_and_finish_reasons(llm):
    out = llm.generate("Count: one, two, three, four,", SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    full = out.text
    assert full, "expected some text"
    stop = full.strip()[3:9]  # a piece of the greedy continuation, likely spanning tokens
    stopped = llm.generate("Count: one, two, three, four,",
                           SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text and full.startswith(stopped.text)
    length = llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_logprobs_and_n(llm, prompt_ids):
    out = llm.generate([prompt_ids[0]], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, n=2))[0]
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for entry, token in zip(completion.logprobs, completion.token_ids):
            assert entry.token_id == token and len(entry.top) == 3
            assert entry.top[0][0] == token  # greedy picks the most likely token
            assert entry.logprob <= 0


def test_abort_stop_and_preemption_mix_frees_every_block(prompt_ids):
    small = LLM("smollm2-135m", dtype="float32", num_blocks=12, max_model_len=96, block_size=16)
    engine = small.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0.8, seed=i, max_tokens=64,
                                                stop=["."] if i % 3 == 0 else (), ignore_eos=i % 3 != 0))
           for i, p in enumerate(prompt_ids)]
    aborted = {ids[1], ids[5]}
    finished = set()
    for step in range(200):
        if step == 10:
            for request_id in aborted:
                engine.abort_request(request_id)
        for output in engine.step():
            assert output.request_id not in aborted or step < 10
            if output.finished:
                finished.add(output.request_id)
        if not engine.has_unfinished_requests():
            break
    assert finished == set(ids) - aborted
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.block_pool.num_free_blocks == 12


def test_bad_input_names_the_field(llm):
    cases = [("", SamplingParams(), "prompt"), ([10**9], SamplingParams(), "prompt"),
             ("hi", SamplingParams(max_tokens=10**6), "max_tokens"),
             ("hi", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias")]
    for prompt, params, field in cases:
        with pytest.raises(ParamError) as info:
            llm.engine.add_request(prompt, params)
        assert info.value.param == field
    assert not llm.engine.has_unfinished_requests()


def test_dummy_preset_generates_from_token_ids():
    llm = LLM("qwen2-0.5b", load_format="dummy", dtype="bfloat16", max_model_len=128, kv_cache_memory_gib=0.1)
    assert llm.tokenizer is None and llm.engine.model_config.attention_bias
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    again = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ParamError) as info:
        llm.engine.add_request("text needs a tokenizer")
    assert info.value.param == "prompt"


def test_memory_budget_sizes_the_kv_pool_from_the_loaded_weights():
    """--memory-gib: the same budget holds more KV blocks when the weights are int4."""
    blocks = {}
    for quantization in ("none", "int4"):
        with LLM(quantization=quantization, dtype="float32", memory_gib=1.0) as llm:
            runner = llm.engine.runner
            block_bytes = runner.kv_cache.gpu.bytes_per_block(llm.engine.model_config, 16, kv_format("float32"))
            free_bytes = (1.0 - ACTIVATION_RESERVE_GIB) * 2**30 - runner.model.gpu_weight_bytes()
            blocks[quantization] = runner.kv_cache.gpu.num_blocks
            assert blocks[quantization] == int(free_bytes // block_bytes)
            assert llm.engine.scheduler.config.num_blocks == blocks[quantization]
    assert blocks["int4"] > blocks["none"]
    with pytest.raises(ConfigError, match="leaves no room"):
        LLM(dtype="float32", memory_gib=0.3)
