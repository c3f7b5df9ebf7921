"""How many drafts a step verifies: each sequence's drafts are worth what it is expected to accept,
and a step's rows cost what decode steps of that many rows were measured to cost.

A step of n rows costs what recent decode-only steps of n rows took (else a line fitted over all
row counts); the j-th draft of a sequence whose drafts are accepted at rate alpha yields alpha^j
tokens. The best drafts are taken, as many as give the step the most tokens per second. Where a
step is bound by reading weights (small batches, streamed layers) a row costs little and k drafts
pay; where it is compute-bound (large batches on a CPU) a draft must be accepted more often than
the step yields tokens per row's cost, and few or none are verified.
"""
from __future__ import annotations

import weakref

from scheduler.sequence import Sequence

FORGET = 0.98  # each step's weight in the fit decays by this per later step: ~50 steps' memory
ROW_SMOOTHING = 0.1  # the weight of a step in its row count's own average
MIN_FIT_ROWS_VARIANCE = 1e-3  # the steps' row counts vary at least this much before a line is fitted
PRIOR_ACCEPTANCE = 0.6  # the rate new sequences start from before any verification
ACCEPTANCE_SMOOTHING = 0.3  # the weight of the latest verification in a sequence's rate
POOLED_SMOOTHING = 0.05  # ... in the rate a new sequence starts from


class StepCosts:
    """Decode-only steps' forward seconds by their rows: each row count's own recent average where
    it was seen (kernels step in row blocks: 5 rows may cost much more than 4), else the line
    a + b * rows fitted over all of them (least squares, older steps forgotten)."""

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._by_rows: dict[int, float] = {}

    def observe(self, num_rows: int, seconds: float) -> None:
        self._n, self._sx, self._sy, self._sxx, self._sxy = (
            FORGET * self._n + 1, FORGET * self._sx + num_rows, FORGET * self._sy + seconds,
            FORGET * self._sxx + num_rows * num_rows, FORGET * self._sxy + num_rows * seconds)
        seen = self._by_rows.get(num_rows)
        self._by_rows[num_rows] = seconds if seen is None else seen + ROW_SMOOTHING * (seconds - seen)

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None until row counts have varied enough to tell b from a."""
        variance = self._sxx / self._n - (self._sx / self._n) ** 2 if self._n else 0.0
        if len(self._by_rows) < 2 or variance < MIN_FIT_ROWS_VARIANCE:
            return None
        b = (self._sxy / self._n - self._sx * self._sy / self._n ** 2) / variance
        a = self._sy / self._n - b * self._sx / self._n
        mean_s = self._sy / self._n
        return max(a, 0.0), max(b, 0.01 * mean_s)  # noise never makes a row free

    def seconds(self, num_rows: int) -> float | None:
        """A step of `num_rows` rows; None while nothing tells."""
        if num_rows in self._by_rows:
            return self._by_rows[num_rows]
        line = self.line()
        return None if line is None else line[0] + line[1] * num_rows


class Acceptance:
    """Each sequence's rate of accepted drafts and its next k (the proposal's length): all
    accepted doubles k up to the most, a rejection sets it to one more than were accepted."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self._rate: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        self._next: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self.pooled = PRIOR_ACCEPTANCE  # over every verification, recent ones weighing most

    def rate(self, seq: Sequence) -> float:
        """Its own rate, or every sequence's so far before its first verification."""
        return self._rate.get(seq, self.pooled)

    def num_drafts(self, seq: Sequence) -> int:
        return self._next.get(seq, self.max_drafts)

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        # a rejection ends the run: the drafts after it were never checked
        checked = min(num_drafts, num_accepted + 1)
        self._rate[seq] = self.rate(seq) + ACCEPTANCE_SMOOTHING * (num_accepted / checked - self.rate(seq))
        self.pooled += POOLED_SMOOTHING * (num_accepted / checked - self.pooled)
        grown = min(self.max_drafts, 2 * num_drafts) if num_accepted == num_drafts else num_accepted + 1
        self._next[seq] = max(1, grown)


def drafts_that_pay(proposed: list[int], rates: list[float], num_rows: int, num_tokens: float,
                    costs: StepCosts) -> list[int]:
    """How many of each sequence's `proposed` drafts to verify in a step of `num_rows` rows that
    yields `num_tokens` tokens without them: the best-valued drafts first (a sequence's j-th is
    worth rate^j tokens), as many as give the step the most tokens per second; all of them until
    steps of different row counts have been seen."""
    if costs.line() is None:  # every step so far had as many rows: drafts are how the costs are learnt
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
