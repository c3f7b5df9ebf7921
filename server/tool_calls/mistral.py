"""Mistral's formats: `[TOOL_CALLS]` then either a JSON array of `{"name", "arguments", "id"}` objects
(tokenizers before v11) or `name[ARGS]{...}` (v11 on; `name[CALL_ID]id[ARGS]{...}` keeps the id),
the marker repeated before each further call. Text before the marker is content.
`[TOOL_CALLS]` is a control token: the text must be decoded with special tokens kept."""
from __future__ import annotations

import re

from server.tool_calls.calls import (ParsedOutput, ToolCall, arguments_text, call_from_object, decode_object_at,
                                     join_content, marker_safe_end)

MARKER = "[TOOL_CALLS]"
# name[ARGS] or name[CALL_ID]id[ARGS], the head of a v11 call
_NAMED_CALL_HEAD = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?\[ARGS\]")


class MistralParser:
    name = "mistral"

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        """What follows a marker and is no call stays content, marker included. When not final, reading
        stops at such a point instead: more text may complete the calls there."""
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while (start := text.find(MARKER, position)) >= 0:
            content.append(text[position:start])
            found = _calls_after_marker(text, start + len(MARKER))
            if found is None and not final:
                position = start
                break
            if found is None:
                content.append(MARKER)
                position = start + len(MARKER)
                continue
            new_calls, position = found
            calls.extend(new_calls)
        content.append(text[position:])
        return ParsedOutput(join_content(content), calls)

    def content_safe_end(self, text: str) -> int:
        return marker_safe_end(text, MARKER)


def _calls_after_marker(text: str, start: int) -> tuple[list[ToolCall], int] | None:
    """The calls that follow a marker ending at `start`, and where they end; None when what follows is
    no complete call (an array counts only when every entry is a call)."""
    decoded = decode_object_at(text, start)
    if decoded is not None and isinstance(decoded[0], list):
        calls = [call_from_object(entry) for entry in decoded[0]]
        if not calls or any(call is None for call in calls):
            return None
        return calls, decoded[1]
    head = _NAMED_CALL_HEAD.match(text, start)
    if head is None:
        return None
    decoded = decode_object_at(text, head.end())
    arguments = None if decoded is None else arguments_text(decoded[0])
    if arguments is None:
        return None
    name, model_id = head.group(1), head.group(2)
    call = ToolCall(name, arguments, model_id) if model_id else ToolCall(name, arguments)
    return [call], decoded[1]
