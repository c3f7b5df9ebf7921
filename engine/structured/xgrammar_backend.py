"""Structured outputs through xgrammar: its compiler (thread-safe, with a cache of compiled
grammars) and one GrammarMatcher per sequence."""
from __future__ import annotations

import json
import logging
import re

import xgrammar as xgr

from engine.text import Tokenizer
from scheduler.structured_output import GrammarError, StructuredOutput

logger = logging.getLogger(__name__)

# compiled grammars kept for reuse: agents send the same tool schemas request after request
_CACHE_LIMIT_BYTES = 256 * 2**20
_COMPILE_THREADS = 2
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# the library's C++ messages begin with "[time] path/file.cc:line: "
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class XGrammarBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS,
                                             cache_limit_bytes=_CACHE_LIMIT_BYTES)

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        try:
            return self._compile(structured)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(_library_message(exc)) from None

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        # compact JSON (no free whitespace): a small model left free whitespace may pad forever
        if structured.kind == "json_schema":
            return self._compiler.compile_json_schema(structured.spec, any_whitespace=False)
        if structured.kind == "json_object":
            return self._compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
        if structured.kind == "regex":
            return self._compiler.compile_regex(structured.spec)
        if structured.kind == "choice":
            return self._compiler.compile_grammar(_choice_grammar(json.loads(structured.spec)))
        return self._compiler.compile_grammar(structured.spec)

    def start(self, compiled: xgr.CompiledGrammar) -> "_XGrammarState":
        return _XGrammarState(xgr.GrammarMatcher(compiled))


class _XGrammarState:
    __slots__ = ("_matcher",)

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        accepted = self._matcher.accept_token(token_id)
        if not accepted:  # the sampler only draws allowed tokens: this is a bug, not bad input
            logger.warning("the grammar refused sampled token %d", token_id)
        return accepted

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def _choice_grammar(choices: list[str]) -> str:
    # a JSON string literal is a valid EBNF string literal in xgrammar's grammar syntax
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _library_message(exc: Exception) -> str:
    return _SOURCE_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
