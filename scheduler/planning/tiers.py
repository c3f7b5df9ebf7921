"""Where a weight is stored: the word every planner, part and report uses. Plain Python."""
from __future__ import annotations

from enum import Enum


class Tier(str, Enum):
    """Where a weight is stored."""

    GPU = "gpu"
    HOST = "host"
    DISK = "disk"

    def __str__(self) -> str:
        return self.value
