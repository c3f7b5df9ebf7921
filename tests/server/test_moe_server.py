"""`tandem serve` on a mixture-of-experts preset (qwen3-moe-tiny, dummy weights): the official
openai SDK gets the offline engine's greedy tokens, streamed and not, over several prompts at once."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tandem_server import EXTRA_FLAGS_ENV, REQUEST_TIMEOUT_S, metric, scrape

# MoE layers are served resident: the flags a suite adds to every server (make test-streamed's
# weight budget) are not for this one
pytestmark = pytest.mark.skipif(bool(os.environ.get(EXTRA_FLAGS_ENV)),
                                reason=f"{EXTRA_FLAGS_ENV} adds flags (a weight budget) MoE serving does not take")
MOE_PRESET = "qwen3-moe-tiny"
PROMPTS = [[5, 17, 301, 44], [9] * 11, [100, 200, 300, 400, 500, 7, 8]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_server(start_server):
    return start_server("--model", MOE_PRESET, "--load-format", "dummy")


@pytest.fixture(scope="module")
def moe_client(moe_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{moe_server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def offline_greedy() -> list[list[int]]:
    from engine import LLM, SamplingParams
    with LLM(MOE_PRESET, load_format="dummy", dtype="float32") as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outputs]


def completion_token_ids(client: openai.OpenAI, prompt: list[int], stream: bool) -> list[int]:
    """The greedy completion's token ids: without a tokenizer the server names each token by its id."""
    kwargs = dict(model=MOE_PRESET, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True})
    if not stream:
        (choice,) = client.completions.create(**kwargs).choices
        assert choice.finish_reason == "length"
        return [int(token) for token in choice.logprobs.tokens]
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    return [int(token) for c in chunks for token in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]


@pytest.mark.parametrize("stream", [False, True])
def test_moe_preset_serves_the_engines_greedy_tokens(moe_client, offline_greedy, stream):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: the prompts share iterations
        got = list(pool.map(lambda p: completion_token_ids(moe_client, p, stream), PROMPTS))
    assert got == offline_greedy


def test_moe_preset_is_listed_and_counts_every_expert(moe_client, moe_server):
    (model,) = moe_client.models.list().data
    assert model.id == MOE_PRESET
    with httpx.Client(base_url=moe_server.url, timeout=REQUEST_TIMEOUT_S) as http:
        samples = scrape(http)
    # qwen3-moe-tiny: vocab 512, hidden 128, 2 layers, 4 heads and 2 KV heads of 32, 8 experts of 64
    vocab, hidden, heads, kv_heads, head_dim, experts, width = 512, 128, 4, 2, 32, 8, 64
    layer = (2 * hidden + 2 * head_dim + hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
             + experts * hidden + experts * 3 * width * hidden)
    num_params = 2 * vocab * hidden + hidden + 2 * layer  # untied embeddings and LM head, final norm
    assert metric(samples, "weight_bytes", format="float32", tier="accelerator") == 4 * num_params
