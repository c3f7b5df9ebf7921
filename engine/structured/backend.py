"""The grammar library behind structured outputs, behind a small interface and a registry.

xgrammar is the one registered: on the embedded model's 49152-token vocabulary it fills a JSON
schema's next-token mask in a median 1-5 us (p99 4-17 us), against llguidance's 4-18 us (p99
20-86 us); benchmarks/serving/structured_decode.py measures both side by side.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from engine.text import Tokenizer
from scheduler.structured_output import GrammarError, GrammarState, StructuredOutput

__all__ = ["GRAMMAR_BACKENDS", "GrammarBackend", "GrammarError", "create_grammar_backend"]


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer's vocabulary and starts sequences in them. `compile` is
    called from the server's threads, `start` from the engine's: both must be thread-safe."""

    def compile(self, structured: StructuredOutput) -> Any:
        """The compiled grammar of `structured`, cached by spec; GrammarError if it cannot be compiled."""

    def start(self, compiled: Any) -> GrammarState:
        """A fresh state at the start of `compiled`, for one sequence."""


def _xgrammar(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    from engine.structured.xgrammar_backend import XGrammarBackend  # deferred: importing xgrammar takes ~1 s
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)


GRAMMAR_BACKENDS: dict[str, Callable[[Tokenizer, int, tuple[int, ...]], GrammarBackend]] = {"xgrammar": _xgrammar}


def create_grammar_backend(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                           name: str = "xgrammar") -> GrammarBackend:
    """The backend `name` for `tokenizer`, masking a model vocabulary of `vocab_size` (>= the
    tokenizer's); a finished output may end with any of `stop_token_ids` (default: the tokenizer's EOS)."""
    return GRAMMAR_BACKENDS[name](tokenizer, vocab_size, stop_token_ids or tokenizer.eos_token_ids)
