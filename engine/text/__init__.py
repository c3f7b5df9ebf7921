"""Text: tokenizer and chat template, incremental detokenizer, stop strings."""
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_strings import StopStrings
from engine.text.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopStrings", "Tokenizer", "TokenizerError"]
