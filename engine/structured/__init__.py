"""Structured outputs: a request's JSON schema, regex, choice or grammar compiled by a grammar
library, and the token masks that hold each sequence's output to it."""
from engine.structured.backend import GrammarBackend, GrammarError, create_grammar_backend
from engine.structured.mask import apply_token_masks

__all__ = ["GrammarBackend", "GrammarError", "apply_token_masks", "create_grammar_backend"]
