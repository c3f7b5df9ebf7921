"""How many drafts a step verifies: each sequence's drafts are worth what it is expected to accept,
and cost their rows in the forward plus the proposer's steps that make them.

A step of n rows costs what recent decode-only forwards of n rows took (between seen row counts,
linearly; past the largest, on the last slope). A proposer drafting j tokens for m sequences runs
j steps of its own (a draft model's forwards; an n-gram lookup's are nearly free), the s-th over
the sequences given at least s drafts, each costing what its steps over that many sequences took
(from nothing at none). The j-th draft of a sequence whose drafts are accepted at rate alpha yields alpha^j
tokens. The best drafts are taken, as many as give the step the most tokens per second. Where a
step is bound by reading weights (small batches, streamed layers) a row costs little and k drafts
pay; where it is compute-bound (large batches on a CPU) a draft must be accepted more often than
the step yields tokens per row's cost, and few or none are verified.
"""
from __future__ import annotations

import statistics
import weakref
from collections import deque

from scheduler.planning.fit.speculation import ACCEPTANCE_PRIOR
from scheduler.sequence import Sequence

RECENT_STEPS = 9  # a row count's cost is the median of its last this many steps
MIN_ROW_SHARE = 0.05  # past the row counts seen, a row costs at least this share of a row's average
PRIOR_ACCEPTANCE = ACCEPTANCE_PRIOR  # the rate new sequences start from before any verification
ACCEPTANCE_SMOOTHING = 0.3  # the weight of the latest verification in a sequence's rate
POOLED_SMOOTHING = 0.05  # ... in the rate a new sequence starts from


class StepCosts:
    """Decode-only steps' seconds by their rows: the median of each row count's recent steps
    where it was seen, after its first (a new shape's first call allocates and plans; kernels
    step in row blocks, so 5 rows may cost much more than 4), never more than a larger count's (fewer rows never cost more: a
    rare count's one stalled step does not stand), linear between the nearest seen row counts,
    and past the largest on the slope of the two largest (so larger verifies get tried where rows
    were cheap, and not where the step is compute-bound)."""

    def __init__(self, free_at_zero: bool = False) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._warmed: set[int] = set()  # row counts whose first step was seen
        self._table: dict[int, float] | None = None  # built from the samples when first asked
        if free_at_zero:  # a proposer's step over no sequence: below the fewest seen, cost in proportion
            self._samples[0] = deque([0.0])

    def observe(self, num_rows: int, seconds: float) -> None:
        if num_rows not in self._warmed:
            self._warmed.add(num_rows)
            return
        self._samples.setdefault(num_rows, deque(maxlen=RECENT_STEPS)).append(seconds)
        self._table = None

    def seen(self, num_rows: int) -> bool:
        return num_rows in self._samples

    @property
    def known(self) -> bool:
        """Whether steps of two row counts have been seen: before that, a row's cost is unknown."""
        return len(self._samples) >= 2

    def _medians(self) -> dict[int, float]:
        if self._table is None:
            table, cheapest_above = {}, float("inf")
            for rows in sorted(self._samples, reverse=True):
                cheapest_above = table[rows] = min(statistics.median(self._samples[rows]), cheapest_above)
            self._table = table
        return self._table

    def seconds(self, num_rows: int) -> float:
        table = self._medians()
        if len(table) == 1 and num_rows not in table:  # nothing seen past the origin, or one count
            return next(iter(table.values()))
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


class ProposerCosts:
    """A proposer's own work: its steps, by the sequences in them (from nothing at none), and the
    prompt tokens it computes once before its first drafts for a sequence (a draft model's catch-up
    of the prompt), per token. An n-gram lookup observes neither: it is free."""

    def __init__(self) -> None:
        self.steps = StepCosts(free_at_zero=True)
        self._token_s: deque[float] = deque(maxlen=RECENT_STEPS)

    def observe_step(self, num_seqs: int, seconds: float) -> None:
        self.steps.observe(num_seqs, seconds)

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self._token_s.append(seconds / num_tokens)

    def step_s(self, num_seqs: int) -> float:
        return self.steps.seconds(num_seqs)

    def catch_up_s(self, num_tokens: int) -> float:
        """Seconds to catch up on `num_tokens` prompt tokens (0 before any was seen: learnt by trying)."""
        return statistics.median(self._token_s) * num_tokens if self._token_s and num_tokens else 0.0


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
                    costs: StepCosts, proposer: ProposerCosts | None = None,
                    entry_s: list[float] | None = None) -> list[int]:
    """How many of each sequence's `proposed` drafts to verify in a step of `num_rows` rows that
    yields `num_tokens` tokens without them: the best-valued drafts first (a sequence's j-th is
    worth rate^j tokens), as many as give the step the most tokens per second. Each costs its row
    in the forward and its share of the proposer's steps; a sequence's first also `entry_s` (a
    one-time catch-up spread over the steps it pays for). None where this step's row count was never
    seen (its cost without drafts is measured first); where it was, but no other count was, the
    likeliest sequence's all (a crowd's exploring stays cheap)."""
    if not costs.seen(num_rows):  # what drafts add to is measured first
        return [0] * len(proposed)
    if not costs.known:  # then a row's cost from one sequence's drafts
        return _explore(proposed, rates)
    entry_s = entry_s or [0.0] * len(proposed)
    candidates = sorted(((rates[i] ** j, -j, i) for i, count in enumerate(proposed) for j in range(1, count + 1)),
                        reverse=True)
    depth_counts = [0] * (max(proposed, default=0) + 1)  # sequences given at least s drafts: the s-th step's
    best_rate, best_count, tokens, extra_s = num_tokens / costs.seconds(num_rows), 0, num_tokens, 0.0
    for count, (value, minus_j, i) in enumerate(candidates, start=1):
        tokens += value
        depth = -minus_j
        if proposer is not None:
            extra_s += proposer.step_s(depth_counts[depth] + 1) - proposer.step_s(depth_counts[depth])
        if depth == 1:
            extra_s += entry_s[i]
        depth_counts[depth] += 1
        seconds = costs.seconds(num_rows + count) + extra_s
        if tokens / seconds > best_rate:
            best_rate, best_count = tokens / seconds, count
    taken = [0] * len(proposed)
    for _, _, i in candidates[:best_count]:
        taken[i] += 1
    return taken


def _explore(proposed: list[int], rates: list[float]) -> list[int]:
    """All of the likeliest sequence's drafts, none of the others'."""
    taken = [0] * len(proposed)
    offered = [i for i, count in enumerate(proposed) if count > 0]
    if offered:
        best = max(offered, key=lambda i: rates[i])
        taken[best] = proposed[best]
    return taken
