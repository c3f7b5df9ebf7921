"""A mode: one of a knob's named choices (auto, on, off, ...), an Enum whose members are their flag's
words. Plain Python."""
from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """A choice that equals its word and prints as it, so the command line, a YAML file and a
    TANDEM_ variable give it as text and a report shows it as the flag takes it."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object) -> "Mode":
        """`value` (a member, or its word) as a member; ValueError listing the words otherwise."""
        try:
            return cls(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be one of {', '.join(member.value for member in cls)}, got {value!r}") from None
