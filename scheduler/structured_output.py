"""What a request asks its output to match, and the per-sequence state that enforces it.

A `StructuredOutput` is the request's side: a JSON schema, any JSON object, a regular expression,
one of several strings, or an EBNF grammar. The engine compiles it once per request
(engine/structured) and gives each sample a `GrammarState`, which the sampler asks for the tokens
allowed next and `Sequence.append_token` advances. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """`spec` by kind: json_schema the schema's JSON text, regex the pattern, choice a JSON list of
    the allowed strings, grammar EBNF text, json_object nothing. `param` is the request field a
    spec the grammar library refuses is blamed on."""

    kind: str
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:  # the server builds only these: another is a caller's bug
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of "
                             f"{', '.join(STRUCTURED_KINDS)}")


class GrammarError(ValueError):
    """A structured output spec the grammar library cannot compile; the message says why."""


class GrammarState(Protocol):
    """One sequence's place in its grammar."""

    def fill_mask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed bitmask (bit set: allowed)."""

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The output is complete and its end token was taken: nothing more may follow."""
