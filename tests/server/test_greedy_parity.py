"""Greedy output over HTTP equals the offline `LLM(dtype="float32")` output for the same prompt."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tandem_server import MODEL

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Q: What is 2 + 2?\nA:"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_text_prompt(client, llm, prompt):
    (expected,) = llm.generate(prompt, GREEDY)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_completion_token_ids_batch(client, llm):
    """A list of token-id prompts in one request, batched on the server, equals each alone offline."""
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = llm.generate(prompt_ids, GREEDY)
    out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0,
                                    logprobs=0)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [e.outputs[0].text for e in expected]
    # the tokens themselves, not just the text: logprobs list each sampled token
    for choice, exp in zip(sorted(out.choices, key=lambda c: c.index), expected):
        assert choice.logprobs.tokens == [llm.tokenizer.token_text(t) for t in exp.outputs[0].token_ids]


def test_chat_equals_llm_chat(client, llm):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the tallest mountain on Earth?"}]
    (expected,) = llm.chat(messages, GREEDY)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.content == expected.outputs[0].text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streaming_equals_llm(client, llm):
    prompt = PROMPTS[0]
    (expected,) = llm.generate(prompt, GREEDY)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected.outputs[0].text
