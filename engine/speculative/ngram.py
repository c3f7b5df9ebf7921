"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs,
searched over its own prompt and output.

Each sequence keeps an index of its n-grams (n-gram -> where its latest occurrence starts), grown
by the tokens added since its last proposal, so a step's lookup costs a few dictionary reads
whatever the context's length; `ngram_drafts` is the plain search it answers as.
"""
from __future__ import annotations

import weakref

from engine.speculative.budget import ProposerCosts
from engine.speculative_config import SpeculativeConfig
from scheduler.sequence import Sequence


class NgramIndex:
    """The n-grams (min_n..max_n tokens) of a growing token list that end before its last token."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `starts`

    def drafts(self, tokens: list[int], num_drafts: int) -> list[int]:
        self._grow(tokens, len(tokens) - 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + num_drafts]
        return []

    def _grow(self, tokens: list[int], end: int) -> None:
        """Index the n-grams ending at positions [num_indexed, end)."""
        for last in range(self.num_indexed, end):
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                self.starts[tuple(tokens[last + 1 - n:last + 1])] = last + 1 - n
        self.num_indexed = max(self.num_indexed, end)


class NgramProposer:
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, requests: list[tuple[Sequence, int]], costs: ProposerCosts) -> list[list[int]]:
        """Up to k drafts for each (sequence, k); [] where no suffix recurs. A lookup costs nothing
        worth pricing."""
        return [self._index(seq).drafts(seq.all_token_ids, k) if k > 0 else [] for seq, k in requests]

    def catch_up_tokens(self, seq: Sequence) -> int:
        return 0  # the index grows by the tokens it has not seen as it looks up

    def close(self) -> None:
        pass  # nothing but dictionaries

    def _index(self, seq: Sequence) -> NgramIndex:
        if seq not in self._indexes:
            self._indexes[seq] = NgramIndex(self.min_n, self.max_n)
        return self._indexes[seq]


def ngram_drafts(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The plain search: the up to `num_drafts` tokens after the latest earlier match of `tokens`'
    longest recurring suffix of min_n..max_n tokens (a match ends before the last token)."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[-n:]]
        if starts:
            return tokens[starts[-1] + n:starts[-1] + n + num_drafts]
    return []
