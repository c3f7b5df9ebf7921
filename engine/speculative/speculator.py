"""Speculative decoding's side of an iteration: drafts for the plan's decodes before the forward,
what their verification showed after it.

`draft` turns decodes of a scheduled plan into verify shares (the last token and up to k drafts,
each a decode row of its own position) where the proposer has drafts, they pay for their rows
(budget.py), the token budget has room and free blocks hold their slots (drafts never preempt).
Rejected drafts' slots are rolled back by not counting them: a sequence's computed tokens
advance by the tokens taken, so the next forward overwrites those slots, and the prefix cache
hashes a block only once its tokens are taken.
"""
from __future__ import annotations

from typing import Protocol

from engine.speculative.budget import Acceptance, ProposerCosts, StepCosts, drafts_that_pay
from engine.speculative_config import SpeculativeConfig
from engine.speculative.counts import VerifyCounts
from scheduler.iteration_plan import IterationPlan, ScheduledSeq
from scheduler.planning.fit.speculation import tokens_per_verify
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence


class Proposer(Protocol):
    name: str

    def propose(self, requests: list[tuple[Sequence, int]], costs: ProposerCosts) -> list[list[int]]:
        """Up to k draft tokens for each (sequence, k), in order; what its own work took goes
        into `costs`."""

    def catch_up_tokens(self, seq: Sequence) -> int:
        """Prompt tokens it must compute once before it can draft for `seq` (0: none, or a few
        that its priced steps cover)."""

    def close(self) -> None:
        """Release what it holds (a draft model's threads)."""


DECODE_LISTS = ("decodes", "batch0_cpu_decodes", "batch1_cpu_decodes")  # either pool's sequences verify


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.acceptance = Acceptance()
        self.step_costs = StepCosts()  # the forward and verifying, by rows
        self.proposer_costs = ProposerCosts()
        self.totals = VerifyCounts()  # since the engine started

    def draft(self, plan: IterationPlan, scheduler: Scheduler) -> None:
        """Give the plan's decodes their drafts (in place): each that gets some becomes a verify
        share in its place. How many each may have is decided before any is proposed (a draft
        model's drafts cost a step of its own each); the proposal may bring fewer. Adaptive, a step
        carrying prompt chunks gets none: its prompt rows make it compute-bound, and only
        decode-only steps teach what rows cost."""
        decodes = [share for name in DECODE_LISTS for share in getattr(plan, name)]
        budget = scheduler.config.max_num_batched_tokens - plan.num_batched_tokens
        wanted = [(share, count) for share, count in zip(decodes, self._counts(plan, decodes)) if count > 0]
        if budget <= 0 or not wanted:
            return
        proposals = self.proposer.propose([(share.sequence, count) for share, count in wanted], self.proposer_costs)
        verifies = {}
        for (share, _), tokens in zip(wanted, proposals):
            tokens = tokens[:budget]
            seq = share.sequence
            if not tokens or not scheduler.reserve_slots(seq, seq.num_tokens + len(tokens)):
                continue
            budget -= len(tokens)
            verifies[id(seq)] = ScheduledSeq(seq, share.num_computed_tokens, 1 + len(tokens), samples=False,
                                             draft_token_ids=tuple(tokens))
        for name in DECODE_LISTS:
            setattr(plan, name, [verifies.get(id(share.sequence), share) for share in getattr(plan, name)])

    def close(self) -> None:
        self.proposer.close()

    def _counts(self, plan: IterationPlan, decodes: list[ScheduledSeq]) -> list[int]:
        """How many drafts each of `decodes` may have: as many as it can take, or adaptive, as many
        as pay (none in a step carrying prompt chunks)."""
        counts = [self._num_drafts(share.sequence) for share in decodes]
        if not self.config.adaptive:
            return counts
        if plan.prefills:
            return [0] * len(decodes)
        rates = [self.acceptance.rate(share.sequence) for share in decodes]
        entry_s = [self._entry_s(share.sequence, rate, count) for share, rate, count in zip(decodes, rates, counts)]
        return drafts_that_pay(counts, rates, plan.num_batched_tokens, len(decodes), self.step_costs,
                               self.proposer_costs, entry_s)

    def _entry_s(self, seq: Sequence, rate: float, num_drafts: int) -> float:
        """The proposer's catch-up on `seq`'s prompt, spread over the verifies left to it."""
        catch_up_s = self.proposer_costs.catch_up_s(self.proposer.catch_up_tokens(seq)) if num_drafts else 0.0
        if not catch_up_s:
            return 0.0
        return catch_up_s * tokens_per_verify(rate, num_drafts) / max(1, self._tokens_left(seq))

    def _tokens_left(self, seq: Sequence) -> int:
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        return room if max_tokens is None else min(room, max_tokens - seq.num_output_tokens)

    def _num_drafts(self, seq: Sequence) -> int:
        """The most drafts `seq` may have: num_speculative_tokens, within its context and its
        max_tokens (the token the verify draws last is one more)."""
        return max(0, min(self.config.num_speculative_tokens, self._tokens_left(seq) - 1))

    def observe_step(self, plan: IterationPlan, forward_s: float) -> None:
        """A step's forward and verifying: decode-only steps teach the cost of a row."""
        if not plan.prefills and plan.num_batched_tokens:
            self.step_costs.observe(plan.num_batched_tokens, forward_s)

    def observe(self, shares: list[ScheduledSeq], counts: VerifyCounts) -> None:
        """A step's verification: each sequence's acceptance, and the running totals."""
        self.totals.add(counts)
        for share, num_accepted in zip(shares, counts.accepted_by_share):
            self.acceptance.observe(share.sequence, len(share.draft_token_ids), num_accepted)
