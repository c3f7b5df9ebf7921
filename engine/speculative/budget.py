"""How many drafts a step verifies: each sequence's drafts are worth what it is expected to accept,
and a step's rows cost what decode steps of that many rows were measured to cost.

A verify row costs b seconds beside a step's a + b * rows (least squares over recent decode-only
steps, older ones forgotten); the j-th draft of a sequence whose drafts are accepted at rate
alpha yields alpha^j tokens. Drafts are taken best first while each raises the step's tokens per
second: where a step is bound by reading weights (small batches, streamed layers) b is small and
k drafts cost little; where it is compute-bound (large batches on a CPU) a draft must be accepted
more often than the step's tokens per row to pay, and few or none are verified.
"""
from __future__ import annotations

import weakref

from scheduler.sequence import Sequence

FORGET = 0.98  # each step's weight in the fit decays by this per later step: ~50 steps' memory
MIN_FIT_ROWS_SPREAD = 1.0  # row counts must vary this much (their spread) before the fit is used
PRIOR_ACCEPTANCE = 0.6  # a sequence's acceptance rate before its first verification
ACCEPTANCE_SMOOTHING = 0.3  # the weight of the latest verification in a sequence's rate


class StepCostFit:
    """Decode-only steps' forward seconds against their rows: seconds = a + b * rows."""

    def __init__(self) -> None:
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, num_rows: int, seconds: float) -> None:
        self._n, self._sx, self._sy, self._sxx, self._sxy = (
            FORGET * self._n + 1, FORGET * self._sx + num_rows, FORGET * self._sy + seconds,
            FORGET * self._sxx + num_rows * num_rows, FORGET * self._sxy + num_rows * seconds)

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None until row counts have varied enough to tell b from a."""
        if self._n < 2:
            return None
        variance = self._sxx / self._n - (self._sx / self._n) ** 2
        if variance < MIN_FIT_ROWS_SPREAD:
            return None
        b = (self._sxy / self._n - self._sx * self._sy / self._n ** 2) / variance
        a = self._sy / self._n - b * self._sx / self._n
        mean_s = self._sy / self._n
        return max(a, 0.0), max(b, 0.01 * mean_s)  # noise never makes a row free


class Acceptance:
    """Each sequence's rate of accepted drafts and its next k (the proposal's length): all
    accepted doubles k up to the most, a rejection sets it to one more than were accepted."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self._rate: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        self._next: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def rate(self, seq: Sequence) -> float:
        return self._rate.get(seq, PRIOR_ACCEPTANCE)

    def num_drafts(self, seq: Sequence) -> int:
        return self._next.get(seq, self.max_drafts)

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            return
        # a rejection ends the run: the drafts after it were never checked
        checked = min(num_drafts, num_accepted + 1)
        self._rate[seq] = self.rate(seq) + ACCEPTANCE_SMOOTHING * (num_accepted / checked - self.rate(seq))
        grown = min(self.max_drafts, 2 * num_drafts) if num_accepted == num_drafts else num_accepted + 1
        self._next[seq] = max(1, grown)


def drafts_that_pay(proposed: list[int], rates: list[float], num_rows: int, num_tokens: float,
                    line: tuple[float, float] | None) -> list[int]:
    """How many of each sequence's `proposed` drafts to verify in a step of `num_rows` rows that
    yields `num_tokens` tokens without them: best first while each raises tokens per second;
    all of them while the cost line is not known yet."""
    if line is None:
        return list(proposed)
    a, b = line
    seconds = a + b * num_rows
    candidates = sorted(((rates[i] ** j, i) for i, count in enumerate(proposed) for j in range(1, count + 1)),
                        reverse=True)
    taken = [0] * len(proposed)
    for value, i in candidates:
        if value / b <= num_tokens / seconds:
            break
        taken[i] += 1
        num_tokens, seconds = num_tokens + value, seconds + b
    return taken
