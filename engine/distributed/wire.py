"""An iteration's plan as the driver sends it to the tensor-parallel ranks: the scheduled shares
and block copies, each sequence reduced to what a forward and a sampling step read (its tokens,
blocks, pool and sampling parameters; its grammar's mask for this step already filled, since the
grammar's matcher lives on the driver). Text streams, logprobs and the scheduler's bookkeeping
stay behind."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.structured.mask import allow_all_bitmask
from scheduler.iteration_plan import IterationPlan, ScheduledSeq
from scheduler.sequence import Sequence


@dataclass
class FilledMask:
    """A grammar's packed mask row for one step, filled on the driver (the GrammarState the
    sampler reads, reduced to `fill_mask`)."""

    row: torch.Tensor  # [words] int32

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.row

    def accept(self, token_id: int) -> bool:
        raise RuntimeError("a rank's copy of a grammar only masks; the driver's advances")

    def is_terminated(self) -> bool:
        return False


def wire_plan(plan: IterationPlan, vocab_size: int) -> IterationPlan:
    """The plan's forward and sampling as the ranks need them (swaps as block copies, no
    preemption or placement records)."""
    def share(scheduled: ScheduledSeq) -> ScheduledSeq:
        return ScheduledSeq(_wire_sequence(scheduled.sequence, vocab_size), scheduled.num_computed_tokens,
                            scheduled.num_new_tokens, scheduled.samples, scheduled.draft_token_ids)

    return IterationPlan(prefills=[share(s) for s in plan.prefills], decodes=[share(s) for s in plan.decodes],
                         batch0_cpu_decodes=[share(s) for s in plan.batch0_cpu_decodes],
                         batch1_cpu_decodes=[share(s) for s in plan.batch1_cpu_decodes],
                         copies=list(plan.copies), mode=plan.mode, estimated_time=plan.estimated_time)


def _wire_sequence(seq: Sequence, vocab_size: int) -> Sequence:
    grammar = None
    if seq.grammar is not None:
        bitmask = allow_all_bitmask(1, vocab_size)
        seq.grammar.fill_mask(bitmask, 0)
        grammar = FilledMask(bitmask[0])
    return Sequence(seq.seq_id, seq.prompt_token_ids, seq.sampling_params, seq.eos_token_ids,
                    output_token_ids=list(seq.output_token_ids), num_computed_tokens=seq.num_computed_tokens,
                    block_ids=list(seq.block_ids), tier=seq.tier, request_id=seq.request_id,
                    partial_prompt_logprobs=[None] * len(seq.partial_prompt_logprobs), grammar=grammar)
