"""`tandem serve` on a mixture-of-experts preset (qwen3-moe-tiny, dummy weights), with every layer
resident and with its experts sliced across the CPU, host memory and the GPU
(`--mlp-slicing`): the official openai SDK gets the offline resident engine's greedy tokens,
streamed and not, over several prompts at once, and /metrics counts every expert in its tier."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tandem_server import EXTRA_FLAGS_ENV, REQUEST_TIMEOUT_S, metric, scrape, wait_idle

# MoE layers are not streamed whole: the flags a suite adds to every server (make test-streamed's
# weight budget) are not for this one
pytestmark = pytest.mark.skipif(bool(os.environ.get(EXTRA_FLAGS_ENV)),
                                reason=f"{EXTRA_FLAGS_ENV} adds flags (a weight budget) MoE serving does not take")
MOE_PRESET = "qwen3-moe-tiny"
PROMPTS = [[5, 17, 301, 44], [9] * 11, [100, 200, 300, 400, 500, 7, 8]]
MAX_TOKENS = 12
# qwen3-moe-tiny: vocab 512, hidden 128, 2 layers, 4 heads and 2 KV heads of 32, 8 experts of 64
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_WIDTH, LAYERS = 512, 128, 4, 2, 32, 8, 64, 2
# each layer's experts 0-1 computed by the CPU, 2-3 streamed, 4-7 resident
SLICING = ("--mlp-slicing", "0.25,0.25")
EXPERTS_IN_HOST_MEMORY = 4


@pytest.fixture(scope="module", params=[False, True], ids=["resident", "sliced"])
def sliced(request) -> bool:
    """Whether the server slices the experts (SLICING) or keeps every layer resident."""
    return request.param


@pytest.fixture(scope="module")
def moe_server(start_server, sliced):
    return start_server("--model", MOE_PRESET, "--load-format", "dummy", *(SLICING if sliced else ()))


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


def test_moe_preset_is_listed_and_counts_every_expert(moe_client, moe_server, sliced):
    (model,) = moe_client.models.list().data
    assert model.id == MOE_PRESET
    with httpx.Client(base_url=moe_server.url, timeout=REQUEST_TIMEOUT_S) as http:
        samples = scrape(http)
    expert_bytes = 4 * 3 * EXPERT_WIDTH * HIDDEN
    layer = (2 * HIDDEN + 2 * HEAD_DIM + HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
             + EXPERTS * HIDDEN + EXPERTS * 3 * EXPERT_WIDTH * HIDDEN)
    model_bytes = 4 * (2 * VOCAB * HIDDEN + HIDDEN + LAYERS * layer)  # untied embeddings and LM head, final norm
    host_bytes = LAYERS * EXPERTS_IN_HOST_MEMORY * expert_bytes if sliced else 0
    assert metric(samples, "weight_bytes", format="float32", tier="gpu") == model_bytes - host_bytes
    if sliced:
        assert metric(samples, "weight_bytes", format="float32", tier="host") == host_bytes


def test_sliced_experts_ran_on_the_cpu_and_were_streamed(moe_client, moe_server, sliced):
    """The CPU computed its experts, CG's were copied in."""
    if not sliced:
        pytest.skip("every expert is resident")
    completion_token_ids(moe_client, PROMPTS[0], stream=False)
    with httpx.Client(base_url=moe_server.url, timeout=REQUEST_TIMEOUT_S) as http:
        samples = wait_idle(http)
    assert metric(samples, "mlp_cpu_seconds_total") > 0
    assert metric(samples, "weight_streamed_bytes_total", tier="host") > 0
