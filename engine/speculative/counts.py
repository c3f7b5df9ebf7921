"""What verification counted: vLLM's spec-decode metrics, per step and in total. No torch."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VerifyCounts:
    """One step's verification, as vLLM's spec-decode metrics count it."""

    num_drafts: int = 0  # verify shares
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at each position
    num_emitted_tokens: int = 0  # tokens taken: accepted drafts and each share's last draw
    accepted_by_share: list[int] = field(default_factory=list)  # per share, in order

    def add(self, other: "VerifyCounts") -> None:
        """Sum `other` into these counts (a running total; per-share counts are not kept)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        for position, count in enumerate(other.accepted_per_position):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += count

    def accept(self, share: int, position: int) -> None:
        self.num_accepted_tokens += 1
        self.accepted_by_share[share] += 1
        while len(self.accepted_per_position) <= position:
            self.accepted_per_position.append(0)
        self.accepted_per_position[position] += 1
