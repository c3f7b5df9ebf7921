"""Prompt lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs,
searched over its own prompt and output. No model, no state: a sequence's drafts are a function
of its tokens."""
from __future__ import annotations

import numpy as np

from engine.speculative.config import SpeculativeConfig
from scheduler.sequence import Sequence


class NgramProposer:
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Up to k drafts for each (sequence, k); [] where no suffix recurs."""
        return [ngram_drafts(seq.all_token_ids, k, self.min_n, self.max_n) if k > 0 else []
                for seq, k in requests]


def ngram_drafts(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The up to `num_drafts` tokens after the latest earlier match of `tokens`' longest recurring
    suffix of min_n..max_n tokens."""
    ids = np.asarray(tokens, dtype=np.int64)
    num_tokens = len(ids)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # windows that start before the suffix itself and leave at least one token after them
        windows = np.lib.stride_tricks.sliding_window_view(ids[:num_tokens - 1], n)
        hits = np.flatnonzero((windows == ids[num_tokens - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + num_drafts].tolist()
    return []
