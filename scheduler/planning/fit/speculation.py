"""What speculative decoding is expected to give a planned configuration (`tandem plan`).

A sequence verifying k drafts is k + 1 decode rows in one forward, each attending to the whole
context; at acceptance rate a it yields the accepted run and the token drawn after it,
(1 - a^(k+1)) / (1 - a) tokens. The best k is the one with the most tokens a second, as the
engine's speculator picks per step from measured costs (engine/speculative/budget.py); a draft
model's own steps are not priced here. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

ACCEPTANCE_PRIOR = 0.6  # the rate the engine's sequences start from before any verification


@dataclass(frozen=True)
class SpeculationGain:
    """At `num_seqs` sequences decoding: the drafts a sequence that pays most, and the tokens a
    second with them over those without (1.0 with none: none pays)."""

    num_seqs: int
    num_drafts: int
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {"num_seqs": self.num_seqs, "num_drafts": self.num_drafts, "speedup": self.speedup}


def tokens_per_verify(acceptance: float, num_drafts: int) -> float:
    """A sequence's expected tokens from verifying `num_drafts` drafts accepted at `acceptance`."""
    return sum(acceptance ** j for j in range(num_drafts + 1))


def speculation_gain(forward_s: Callable[[int, int], float], num_seqs: int, max_drafts: int,
                     acceptance: float = ACCEPTANCE_PRIOR) -> SpeculationGain:
    """The best of 0..`max_drafts` drafts a sequence, `forward_s(num_seqs, rows_per_seq)` pricing
    a decode forward."""
    base_rate = num_seqs / forward_s(num_seqs, 1)
    best = SpeculationGain(num_seqs, 0, 1.0)
    for num_drafts in range(1, max_drafts + 1):
        rate = num_seqs * tokens_per_verify(acceptance, num_drafts) / forward_s(num_seqs, num_drafts + 1)
        if rate / base_rate > best.speedup:
            best = SpeculationGain(num_seqs, num_drafts, rate / base_rate)
    return best
