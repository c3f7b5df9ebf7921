"""Incremental detokenization: a stream of sampled token ids becomes text deltas.

`IncrementalDetokenizer` decodes a small window of recent tokens per step, holds back
incomplete UTF-8 characters and anything that could still become a stop string.
"""
from __future__ import annotations

from typing import Sequence

from engine.text.stop_strings import StopStrings
from engine.text.tokenizer import Tokenizer
from scheduler.sampling_params import SamplingParams

# How many prompt tokens precede the first output token in the decode window: enough context
# for a leading space or a character split across the prompt/output boundary.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one request.

    Each step decodes only a window: the tokens of the last emitted delta (context, so that a
    leading space decodes as in the full text) and the tokens decoded since, so a step costs O(1)
    in the output length.
    A delta never ends in an incomplete character, never contains any part of a stop string
    (unless `include_stop_str_in_output`), and nothing follows a matched stop string.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = StopStrings(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # the decode window: [context tokens, already emitted][tokens whose text is not out yet]
        self._token_ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_context_tokens = len(self._token_ids)
        self._held = ""  # decoded text that could be the start of a stop string
        self._pieces: list[str] = []
        self._num_taken_pieces = 0  # pieces already handed out by take_text()
        self._num_output_tokens = 0
        self._done = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def take_text(self) -> str:
        """The text emitted since the previous call (the delta an output carries)."""
        new = "".join(self._pieces[self._num_taken_pieces:])
        self._num_taken_pieces = len(self._pieces)
        return new

    def add(self, token_id: int) -> str:
        """Take one sampled token; return the text that may be emitted now (possibly "").
        After a stop string has matched (`stop_string` is set) further tokens are ignored."""
        if self._done:
            return ""
        self._token_ids.append(token_id)
        self._num_output_tokens += 1
        new_text = self._decode_complete()
        if not self._stop:
            return self._emit(new_text)
        buffer = self._held + new_text
        if self._num_output_tokens >= self._min_tokens:
            match = self._stop.find(buffer, len(self._held))
            if match is not None:
                start, stop = match
                self.stop_string = stop
                self._held = ""
                self._done = True
                return self._emit(buffer[:start + len(stop)] if self._include_stop else buffer[:start])
        num_held = self._stop.partial_length(buffer)
        self._held = buffer[len(buffer) - num_held:]
        return self._emit(buffer[:len(buffer) - num_held])

    def finish(self) -> str:
        """The request ended for another reason than a stop string: release held-back text,
        including bytes that never completed a character."""
        if self._done:
            return ""
        self._done = True
        context_text, full_text = self._decode_window()
        text = self._held + full_text[len(context_text):]
        self._held = ""
        return self._emit(text)

    def _decode_window(self) -> tuple[str, str]:
        """The text of the context tokens and of the whole window."""
        decode = self._tokenizer.decode
        context_ids = self._token_ids[:self._num_context_tokens]
        context_text = decode(context_ids, skip_special_tokens=self._skip_special_tokens)
        full_text = decode(self._token_ids, skip_special_tokens=self._skip_special_tokens)
        return context_text, full_text

    def _decode_complete(self) -> str:
        """The new text up to the last complete character, and advance the window past it."""
        context_text, full_text = self._decode_window()
        if len(full_text) <= len(context_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # a special token that decodes to nothing, or a character still incomplete
        # the tokens just decoded become the next step's context; the old context is dropped
        del self._token_ids[:self._num_context_tokens]
        self._num_context_tokens = len(self._token_ids)
        return full_text[len(context_text):]

    def _emit(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text
