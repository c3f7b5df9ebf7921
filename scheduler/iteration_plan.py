"""The plan the schedulers hand the runner each iteration: which sequences compute how many tokens
in which sub-batch, the KV moves between the pools before the forward, and how the forward runs.
Plain Python, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from scheduler.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of an iteration: compute `num_new_tokens` tokens after the cached
    ones. Only a share that reaches the sequence's last token samples one; an earlier chunk of a
    prefill does not. A verify share (speculative decoding) is a decode whose last token is
    followed by `draft_token_ids`: each of its tokens is a decode row of its own position, and
    each row checks the draft after it (engine/speculative/verify.py) instead of sampling."""

    sequence: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool = True
    draft_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        own = self.sequence.all_token_ids[start:start + self.num_new_tokens - len(self.draft_token_ids)]
        return own + list(self.draft_token_ids)

    @property
    def is_verify(self) -> bool:
        return bool(self.draft_token_ids)

    @property
    def num_output_rows(self) -> int:
        """Logit rows the forward returns for it: every row of a verify share, else its last."""
        return self.num_new_tokens if self.draft_token_ids else 1


@dataclass(frozen=True)
class Swap:
    """Move one sequence's KV between the pools: block `src[i]` of the source pool goes to
    block `dst[i]` of the other. The runner does all swaps before the iteration's forward."""

    sequence: Sequence
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


@dataclass(frozen=True)
class BlockCopy:
    """Copy K/V of every layer from block `src[i]` of one pool to block `dst[i]` of the other
    (`to_cpu`: GPU pool -> host pool). A plan's copies run in order, before its forward."""

    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    to_cpu: bool


class PlanMode(str, Enum):
    """How the runner executes an iteration; the value is the `mode` label of the metrics."""

    GPU_ONLY = "gpu_only"  # one batch, attention on the GPU (layer by layer)
    PIPELINED = "pipelined"  # Neo's asymmetric two-batch forward with CPU decoding attention

    def __str__(self) -> str:
        return self.value


PLAN_MODES = tuple(PlanMode)  # every mode, for whoever counts by mode


@dataclass
class IterationPlan:
    """What the runner executes this iteration.

    Batch-0 packs `prefills`, `decodes` (GPU-sequences) and `batch0_cpu_decodes` (CPU-sequences) in that
    order; batch-1 (`batch1_cpu_decodes`) holds CPU-sequences only. A prefill's KV goes to the pool of
    its sequence's `tier` (CPU: copied out layer by layer). Sampled tokens come back in
    `scheduled` order.
    """

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    batch0_cpu_decodes: list[ScheduledSeq] = field(default_factory=list)
    batch1_cpu_decodes: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[Swap] = field(default_factory=list)  # GPU pool -> CPU pool
    swap_in: list[Swap] = field(default_factory=list)  # CPU pool -> GPU pool
    # Every block copy of the plan, in the order it must run: the swaps above, cached prefixes
    # demoted to the host pool and promoted back to the GPU pool.
    copies: list[BlockCopy] = field(default_factory=list)
    mode: PlanMode = PlanMode.GPU_ONLY
    estimated_time: float | None = None  # seconds, from the cost model when there is one
    # CPU-sequences placed although a pipelining inequality breaks: they had waited too long, or
    # nothing else could run (Neo scheduler's bounded wait); their entries stay in the batches.
    forced: list[Sequence] = field(default_factory=list)

    @property
    def batch0(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes + self.batch0_cpu_decodes

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.batch0 + self.batch1_cpu_decodes

    @property
    def sampling(self) -> list[ScheduledSeq]:
        """The scheduled shares that sample a token, in `scheduled` order (verify shares check
        their drafts instead)."""
        return [s for s in self.scheduled if s.samples]

    @property
    def verifies(self) -> list[ScheduledSeq]:
        """The verify shares (decodes with drafts), in `scheduled` order."""
        return [s for s in self.scheduled if s.is_verify]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)  # a decode's 1, a verify share's 1 + drafts

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.batch0_cpu_decodes or self.batch1_cpu_decodes)
