"""Stop strings: where one matches in generated text, and how much text must be held back
because it could still grow into one."""
from __future__ import annotations

from typing import Sequence


class StopStrings:
    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)

    def __bool__(self) -> bool:
        return bool(self._stop)

    def find(self, buffer: str, num_old_chars: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest stop string in `buffer` that ends in its new text
        (after `num_old_chars`), or None."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = buffer.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start >= 0 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def partial_length(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest
