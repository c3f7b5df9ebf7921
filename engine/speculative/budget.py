"""How many drafts a step verifies: each sequence's drafts are worth what it is expected to accept,
and a step's rows cost what decode steps of that many rows were measured to cost.

A step of n rows costs what recent decode-only steps of n rows took (between seen row counts,
linearly; past the largest, on the last slope); the j-th draft of a sequence whose drafts are accepted at rate alpha yields alpha^j
tokens. The best drafts are taken, as many as give the step the most tokens per second. Where a
step is bound by reading weights (small batches, streamed layers) a row costs little and k drafts
pay; where it is compute-bound (large batches on a CPU) a draft must be accepted more often than
the step yields tokens per row's cost, and few or none are verified.
"""
from __future__ import annotations

import statistics
import weakref
from collections import deque

from scheduler.sequence import Sequence

RECENT_STEPS = 9  # a row count's cost is the median of its last this many steps
MIN_ROW_SHARE = 0.05  # past the row counts seen, a row costs at least this share of a row's average
PRIOR_ACCEPTANCE = 0.6  # the rate new sequences start from before any verification
ACCEPTANCE_SMOOTHING = 0.3  # the weight of the latest verification in a sequence's rate
POOLED_SMOOTHING = 0.05  # ... in the rate a new sequence starts from


class StepCosts:
    """Decode-only steps' seconds by their rows: the median of each row count's recent steps
    where it was seen (robust to a first step's warm-up; kernels step in row blocks, so 5 rows
    may cost much more than 4), linear between the nearest seen row counts, and past the largest
    on the slope of the two largest (so larger verifies get tried where rows were cheap, and not
    where the step is compute-bound)."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}

    def observe(self, num_rows: int, seconds: float) -> None:
        self._samples.setdefault(num_rows, deque(maxlen=RECENT_STEPS)).append(seconds)

    @property
    def known(self) -> bool:
        """Whether steps of two row counts have been seen: before that, a row's cost is unknown."""
        return len(self._samples) >= 2

    def seconds(self, num_rows: int) -> float:
        table = {rows: statistics.median(samples) for rows, samples in self._samples.items()}
        if num_rows in table:
            return table[num_rows]
        below = max((rows for rows in table if rows < num_rows), default=None)
        above = min((rows for rows in table if rows > num_rows), default=None)
        if below is None:
            return table[above]
        if above is None:  # past the largest: on the slope of the two largest, never free
            before = max(rows for rows in table if rows < below)
            slope = (table[below] - table[before]) / (below - before)
            return table[below] + (num_rows - below) * max(slope, MIN_ROW_SHARE * table[below] / below)
        share = (num_rows - below) / (above - below)
        return table[below] + share * (table[above] - table[below])


class Acceptance:
    """Each sequence's rate of accepted drafts: what its j-th draft is worth (rate^j tokens)."""

    def __init__(self) -> None:
        self._rate: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        self.pooled = PRIOR_ACCEPTANCE  # over every verification, recent ones weighing most

    def rate(self, seq: Sequence) -> float:
        """Its own rate, or every sequence's so far before its first verification."""
        return self._rate.get(seq, self.pooled)

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        # a rejection ends the run: the drafts after it were never checked
        accepted = num_accepted / min(num_drafts, num_accepted + 1)
        self._rate[seq] = self.rate(seq) + ACCEPTANCE_SMOOTHING * (accepted - self.rate(seq))
        self.pooled += POOLED_SMOOTHING * (accepted - self.pooled)


def drafts_that_pay(proposed: list[int], rates: list[float], num_rows: int, num_tokens: float,
                    costs: StepCosts) -> list[int]:
    """How many of each sequence's `proposed` drafts to verify in a step of `num_rows` rows that
    yields `num_tokens` tokens without them: the best-valued drafts first (a sequence's j-th is
    worth rate^j tokens), as many as give the step the most tokens per second; all of them until
    steps of different row counts have been seen."""
    if not costs.known:  # every step so far had as many rows: drafts are how the costs are learnt
        return list(proposed)
    base_s = costs.seconds(num_rows)
    candidates = sorted(((rates[i] ** j, i) for i, count in enumerate(proposed) for j in range(1, count + 1)),
                        reverse=True)
    best_rate, best_count, tokens = num_tokens / base_s, 0, num_tokens
    for count, (value, _) in enumerate(candidates, start=1):
        tokens += value
        seconds = costs.seconds(num_rows + count)
        if tokens / seconds > best_rate:
            best_rate, best_count = tokens / seconds, count
    taken = [0] * len(proposed)
    for _, i in candidates[:best_count]:
        taken[i] += 1
    return taken
