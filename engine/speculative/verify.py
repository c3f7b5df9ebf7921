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
from engine.sampling.sampler import needs_processing
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
    drawn_ahead = _greedy_draws(shares, logits, sampler)
    active, position = list(range(len(shares))), 0
    while active:
        if drawn_ahead is None:
            drawn = sampler(torch.stack([logits[i][position] for i in active]), [shares[i].sequence for i in active])
            tokens, entries, failed = drawn.token_ids, drawn.token_logprobs(), drawn.failed_rows
        else:
            tokens, entries = zip(*(drawn_ahead[i][position] for i in active))
            failed = {}
        still = []
        for j, i in enumerate(active):
            share = shares[i]
            if j in failed:
                fail(share.sequence, failed[j])
                continue
            counts.num_emitted_tokens += 1
            if not take(share, position, (tokens[j], entries[j])):
                continue
            if position < len(share.draft_token_ids) and tokens[j] == share.draft_token_ids[position]:
                counts.accept(i, position)
                still.append(i)
        active, position = still, position + 1
    return counts


def _greedy_draws(shares: list[ScheduledSeq], logits: list[torch.Tensor],
                  sampler: Sampler) -> list[list[tuple[int, Any]]] | None:
    """Every row's token and logprobs entry in one sampler call, where no row's draw depends on the
    tokens before it (greedy, no penalties, bias, grammar or min_tokens): per share, per row. None
    otherwise: those are drawn position by position."""
    seqs = [share.sequence for share in shares]
    if not all(seq.sampling_params.greedy for seq in seqs) or needs_processing(seqs):
        return None
    rows = [seq for share, seq in zip(shares, seqs) for _ in range(share.num_output_rows)]
    drawn = sampler(torch.cat(logits), rows)
    if drawn.failed_rows:
        return None  # drawn again position by position, where the failing row is told apart
    pairs, first = list(zip(drawn.token_ids, drawn.token_logprobs())), 0
    per_share = []
    for share in shares:
        per_share.append(pairs[first:first + share.num_output_rows])
        first += share.num_output_rows
    return per_share
