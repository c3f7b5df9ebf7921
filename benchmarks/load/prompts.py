"""Prompts that hit a token count exactly, using the target's own tokenizer when it has one.

Prompts are sequences of common English words drawn with a per-request seed, so every request
sees a different prompt (no accidental prefix-cache hits) and reruns see the same ones. With a
`TokenCounter` (the endpoint's /tokenize), the builder keeps only words that are one token after
a space, then measures and corrects the word count until the endpoint counts exactly the target
(BPE never merges across a space, so one correction usually suffices; chat-template overhead is
measured, not assumed). Without one, a word is taken as a token and the prompt is approximate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import httpx
import numpy as np

# Each of these is one token after a space in the GPT-2, Llama and SmolLM vocabularies; the
# builder still checks them against the target's tokenizer before relying on that.
WORDS = tuple(dict.fromkeys("""
the of and to in is was for on that with as by at from his her an are were which this be has had
not but they their one all two new first time after when would been more its who she other into
only over also some than then these may most made about out up such can there year through them
many where between each during those both three state under while being world high since long
part city name four life work used same well people school area day known later way good right
small great still water game team war back place old around film house story found early best
group before last line family power music three public number local down second book head land
set even five point part river play side music end human light open order form show half sea
black white red green blue north south east west road table paper money market field plan case
week month hand door eye child woman man face voice letter question answer reason result model
system program data value level class paper energy space term rate price heart mind idea center
""".split()))

# Word-count corrections before settling for the closest prompt; each costs one count.
MAX_ADJUSTMENTS = 8
MIN_POOL_WORDS = 16  # fewer one-token words than this and prompts would repeat too much to be realistic
WORDS_PER_DRAW = 64  # words drawn at a time for a prompt's stream
_PROMPT_STREAM = 3  # seed-stream tag, distinct from the length and arrival streams


class TokenCounter(Protocol):
    """Counts the tokens the endpoint will see for a prompt text (chat: wrapped in its template)."""

    def count(self, text: str) -> int: ...


@dataclass(frozen=True)
class Prompt:
    text: str
    num_target_tokens: int
    num_tokens: int | None  # as counted by the endpoint's tokenizer; None when approximate
    exact: bool


class RemoteTokenCounter:
    """Counts with the endpoint's POST /tokenize (vLLM and tandem shape: {"count": n})."""

    def __init__(self, client: httpx.Client, model: str, chat: bool) -> None:
        self.client, self.model, self.chat = client, model, chat

    def count(self, text: str) -> int:
        body = ({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})
        response = self.client.post("/tokenize", json={"model": self.model, **body})
        response.raise_for_status()
        return int(response.json()["count"])


class PromptBuilder:
    def __init__(self, counter: TokenCounter | None, seed: int = 0) -> None:
        self.counter = counter
        self.seed = seed
        self.words = _one_token_words(counter) if counter is not None else WORDS
        # tokens the endpoint adds around a prompt (BOS, chat template): a first guess, corrected per prompt
        self.num_overhead_tokens = counter.count(self.words[0]) - 1 if counter is not None else 0

    def build(self, index: int, num_tokens: int) -> Prompt:
        """The prompt of request `index` with `num_tokens` tokens (exact when a counter is set)."""
        words = _WordStream(np.random.default_rng([self.seed, _PROMPT_STREAM, index]), self.words)
        if self.counter is None:
            return Prompt(words.text(max(1, num_tokens)), num_tokens, None, exact=False)
        num_words = max(1, num_tokens - self.num_overhead_tokens)
        best: tuple[int, str, int] | None = None  # (|error|, text, count)
        for _ in range(MAX_ADJUSTMENTS):
            text = words.text(num_words)
            count = self.counter.count(text)
            if best is None or abs(count - num_tokens) < best[0]:
                best = (abs(count - num_tokens), text, count)
            if count == num_tokens:
                break
            next_num_words = num_words + num_tokens - count
            if next_num_words < 1:
                break  # the target is below the template's own tokens
            num_words = next_num_words
        _, text, count = best
        return Prompt(text, num_tokens, count, exact=count == num_tokens)


class _WordStream:
    """A per-request endless sequence of pool words, drawn lazily from its own generator."""

    def __init__(self, rng: np.random.Generator, pool: tuple[str, ...]) -> None:
        self.rng, self.pool, self.words = rng, pool, []

    def text(self, num_words: int) -> str:
        while len(self.words) < num_words:
            picks = self.rng.integers(0, len(self.pool), size=max(WORDS_PER_DRAW, num_words - len(self.words)))
            self.words.extend(self.pool[i] for i in picks)
        return " ".join(self.words[:num_words])


def _one_token_words(counter: TokenCounter) -> tuple[str, ...]:
    """The pool words that add exactly one token after a space, found by halving mismatched groups."""
    anchor = "the"
    base = counter.count(anchor)
    kept: list[str] = []
    groups = [list(WORDS)]
    while groups:
        group = groups.pop()
        added = counter.count(anchor + "".join(" " + w for w in group)) - base
        if added == len(group):
            kept.extend(group)
        elif len(group) > 1:
            groups += [group[:len(group) // 2], group[len(group) // 2:]]
    if len(kept) < MIN_POOL_WORDS:
        return WORDS  # an unusual tokenizer: keep them all and let the correction loop cope
    return tuple(sorted(kept))
