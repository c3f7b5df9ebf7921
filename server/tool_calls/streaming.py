"""Tool calls out of a generation as it streams, for any format: content is sent as soon as the parser
says no call can start in it, each call is sent whole once no more text can change it, and the end
of the generation sends the rest from one parse of the whole text.

What the stream sends adds up to the whole parse of the text, whatever the chunking: the content
sent, concatenated, equals `parse(text).content or ""` exactly (leading whitespace is never sent,
trailing whitespace is held until more content follows), and the calls sent are parse(text)'s
calls in order (ids aside: each call's id is drawn when the call is first read)."""
from __future__ import annotations

from dataclasses import dataclass, field

from server.tool_calls.calls import ToolCall, ToolCallParser


@dataclass
class StreamDelta:
    """What to send for one step: new content ("" when none) and OpenAI `delta.tool_calls` entries,
    each a whole call with its index among the generation's calls."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.content and not self.tool_calls


class ToolCallStream:
    """One generation's stream: feed() each text delta, then finish() once at its end."""

    def __init__(self, parser: ToolCallParser):
        self._parser = parser
        self._text = ""
        self._num_content_chars_sent = 0
        self._content_end = 0  # where in the text the content sent so far ends
        self._num_calls_sent = 0

    @property
    def num_calls_sent(self) -> int:
        return self._num_calls_sent

    def feed(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        safe_end = self._parser.content_safe_end(self._text)
        delta = StreamDelta(self._new_safe_content(safe_end))
        if safe_end < len(self._text):  # held-back text may hold calls that are complete
            delta.tool_calls = self._new_calls(self._parser.parse(self._text, final=False).tool_calls)
        return delta

    def finish(self) -> StreamDelta:
        """The content and calls the whole text's parse has beyond those sent."""
        parsed = self._parser.parse(self._text)
        return StreamDelta(self._new_content(parsed.content or ""), self._new_calls(parsed.tool_calls))

    def _new_safe_content(self, safe_end: int) -> str:
        """The safe text not yet sent, stripped the way the parse strips content: nothing before the
        first non-space, trailing spaces held. Only the unsent part is read, to stay linear in the text."""
        piece = self._text[self._content_end:safe_end].rstrip()
        self._content_end += len(piece)
        new = piece if self._num_content_chars_sent else piece.lstrip()
        self._num_content_chars_sent += len(new)
        return new

    def _new_content(self, content_so_far: str) -> str:
        """The part of `content_so_far` not yet sent. What was sent is always a prefix of the final
        content: safe text lies before any call and is stripped as the parse strips it."""
        new = content_so_far[self._num_content_chars_sent:]
        self._num_content_chars_sent += len(new)
        return new

    def _new_calls(self, calls: list[ToolCall]) -> list[dict]:
        new = [{"index": index, **call.as_openai()}
               for index, call in enumerate(calls[self._num_calls_sent:], start=self._num_calls_sent)]
        self._num_calls_sent += len(new)
        return new
