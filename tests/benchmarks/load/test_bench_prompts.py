"""The prompt builder hits token counts exactly with the real (embedded SmolLM2) tokenizer."""
from __future__ import annotations

import pytest

from benchmarks.load.prompts import WORDS, PromptBuilder
from engine.text import Tokenizer
from engine.weights import embedded_gguf_path

TARGETS = (1, 2, 7, 64, 129, 500, 2000)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_source(embedded_gguf_path())


class CompletionCounter:
    """What tandem's /tokenize and /v1/completions count for a text prompt."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def count(self, text: str) -> int:
        self.calls += 1
        return len(self.tokenizer.encode(text))


class ChatCounter(CompletionCounter):
    """What tandem counts for one user message rendered by the chat template."""

    def count(self, text: str) -> int:
        self.calls += 1
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return len(self.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("num_tokens", TARGETS)
def test_completion_prompts_are_exact(tokenizer, num_tokens):
    counter = CompletionCounter(tokenizer)
    builder = PromptBuilder(counter, seed=0)
    calls_before = counter.calls
    prompt = builder.build(index=3, num_tokens=num_tokens)
    assert prompt.exact and prompt.num_tokens == num_tokens
    assert len(tokenizer.encode(prompt.text)) == num_tokens  # checked independently of the builder
    assert counter.calls - calls_before <= 3  # one count, at most a correction or two


@pytest.mark.parametrize("num_tokens", [40, 100, 700])
def test_chat_prompts_are_exact_including_the_template(tokenizer, num_tokens):
    counter = ChatCounter(tokenizer)
    prompt = PromptBuilder(counter, seed=1).build(index=0, num_tokens=num_tokens)
    assert prompt.exact and counter.count(prompt.text) == num_tokens
    assert counter.count("") > 20  # the default system prompt is overhead the builder measured


def test_chat_target_below_the_template_is_reported_inexact(tokenizer):
    counter = ChatCounter(tokenizer)
    prompt = PromptBuilder(counter, seed=0).build(index=0, num_tokens=5)
    assert not prompt.exact and prompt.num_tokens == counter.count(prompt.text) > 5


def test_prompts_differ_by_request_and_repeat_by_seed(tokenizer):
    builder = PromptBuilder(CompletionCounter(tokenizer), seed=0)
    texts = [builder.build(i, 64).text for i in range(20)]
    assert len(set(texts)) == 20
    assert len({t.split()[0] for t in texts} | {t.split()[1] for t in texts}) > 5  # no shared prefix
    again = PromptBuilder(CompletionCounter(tokenizer), seed=0)
    assert again.build(7, 64).text == texts[7]
    assert PromptBuilder(CompletionCounter(tokenizer), seed=1).build(7, 64).text != texts[7]


def test_pool_is_filtered_to_one_token_words(tokenizer):
    builder = PromptBuilder(CompletionCounter(tokenizer), seed=0)
    assert len(builder.words) > 100
    for word in builder.words:
        assert len(tokenizer.encode("the " + word)) - len(tokenizer.encode("the")) == 1, word


def test_approximate_fallback_is_close(tokenizer):
    builder = PromptBuilder(None, seed=0)
    for num_tokens in (50, 300, 1000):
        prompt = builder.build(0, num_tokens)
        assert not prompt.exact and prompt.num_tokens is None
        assert len(prompt.text.split()) == num_tokens
        assert len(tokenizer.encode(prompt.text)) == pytest.approx(num_tokens, rel=0.1)
    assert set(builder.words) == set(WORDS)
