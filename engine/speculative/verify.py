"""Verification of drafts in one pass: each verify share's rows, position by position.

Row i of a share holds the target's logits after its last token and drafts 1..i. Its token is
drawn as a decode step would draw it, the drafts before it already taken into the sequence (its
penalties, grammar, min_tokens and seeded noise see them), and taken; the share goes on while that
token is the draft it checks. So greedy text is the text without speculation, and a sampled token
is always a draw from the target's processed distribution: for a draft d proposed with certainty
(n-gram lookup, a greedy draft model) "accept d with probability p(d), else draw from p without
d" is exactly this, the rejection sampling of Leviathan et al. with q a point mass. A seeded
request's draws are the ones it would make without speculation (its noise is keyed by position).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.sampling import Sampler
from engine.speculative.counts import VerifyCounts
from scheduler.iteration_plan import ScheduledSeq
from scheduler.sequence import Sequence


# take(share, position, (token, logprob entry)) -> whether its sequence goes on
TakeToken = Callable[[ScheduledSeq, int, tuple[int, Any]], bool]


def verify(shares: list[ScheduledSeq], logits: list[torch.Tensor], sampler: Sampler, take: TakeToken,
           fail: Callable[[Sequence, str], None]) -> VerifyCounts:
    """Check every share's drafts against its rows (`logits[i]`: [1 + drafts, vocab]); `take`
    appends each token drawn, `fail` ends a request whose sampling raised."""
    counts = VerifyCounts(num_drafts=len(shares), num_draft_tokens=sum(len(s.draft_token_ids) for s in shares),
                          accepted_by_share=[0] * len(shares))
    active, position = list(range(len(shares))), 0
    while active:
        rows = torch.stack([logits[i][position] for i in active])
        drawn = sampler(rows, [shares[i].sequence for i in active])
        entries = drawn.token_logprobs()
        still = []
        for j, i in enumerate(active):
            share = shares[i]
            if j in drawn.failed_rows:
                fail(share.sequence, drawn.failed_rows[j])
                continue
            token = drawn.token_ids[j]
            counts.num_emitted_tokens += 1
            if not take(share, position, (token, entries[j])):
                continue
            if position < len(share.draft_token_ids) and token == share.draft_token_ids[position]:
                counts.accept(i, position)
                still.append(i)
        active, position = still, position + 1
    return counts
