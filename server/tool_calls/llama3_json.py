"""Llama 3.1-3.3 JSON tool calling: the generation is a JSON object `{"name": ..., "parameters": {...}}`
("arguments" is read too), optionally after `<|python_tag|>`, and several calls are separated by `;`.
A generation that does not start with such an object is plain content."""
from __future__ import annotations

from server.tool_calls.calls import ParsedOutput, ToolCall, call_from_object, decode_object_at, join_content

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        """Calls are read from the start for as long as they follow one another; text from the first
        point that is no call on is content. A complete object never changes with more text, so a
        prefix yields the same leading calls whether final or not."""
        calls: list[ToolCall] = []
        position = 0  # where the text not yet read as calls begins
        while (start := _next_call_start(text, position, is_first=not calls)) is not None:
            found = _call_at(text, start)
            if found is None:
                break
            call, position = found
            calls.append(call)
        rest = text[position:]
        if calls:  # a dangling separator after the last call is no content
            rest = rest.lstrip().removeprefix(SEPARATOR)
        return ParsedOutput(join_content([rest]), calls)

    def content_safe_end(self, text: str) -> int:
        """Everything once the text (past leading whitespace) can no longer begin with a call, else nothing."""
        start = text.lstrip()
        if start.startswith("{") or PYTHON_TAG.startswith(start) or start.startswith(PYTHON_TAG):
            return 0
        return len(text)


def _next_call_start(text: str, position: int, *, is_first: bool) -> int | None:
    """Where the next call may start: at `position` for the first, after a separator for the others."""
    if is_first:
        return position
    after_space = len(text) - len(text[position:].lstrip())
    if text.startswith(SEPARATOR, after_space):
        return after_space + len(SEPARATOR)
    return None


def _call_at(text: str, start: int) -> tuple[ToolCall, int] | None:
    """The call whose object starts at `start` (after whitespace and an optional python tag), and its end."""
    after_space = len(text) - len(text[start:].lstrip())
    if text.startswith(PYTHON_TAG, after_space):
        start = after_space + len(PYTHON_TAG)
    decoded = decode_object_at(text, start)
    if decoded is None:
        return None
    call = call_from_object(decoded[0], arguments_required=True)
    return None if call is None else (call, decoded[1])
