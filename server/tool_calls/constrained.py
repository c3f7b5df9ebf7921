"""tandem's constrained formats, generated when the server forces a tool call with a grammar: for
tool_choice "required" the generation is a JSON array of `{"name": ..., "arguments": {...}}` objects,
for a named function it is that function's arguments object alone. The grammar leaves no room for
content, so a generation that does not parse (cut off by max_tokens) is returned as content whole.
The two parser classes let ToolCallStream stream these generations like any other format."""
from __future__ import annotations

import json

from server.tool_calls.calls import ParsedOutput, ToolCall, arguments_text, call_from_object, join_content


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a JSON array of call objects; [] when the text is no such array (all or nothing)."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(entries, list):
        return []
    calls = [call_from_object(entry) for entry in entries]
    return [] if any(call is None for call in calls) else calls


def parse_named(text: str, name: str) -> ToolCall | None:
    """The call of function `name` whose arguments object is the whole text; None when it is no object."""
    try:
        arguments = arguments_text(json.loads(text))
    except json.JSONDecodeError:
        return None
    return None if arguments is None else ToolCall(name, arguments)


class RequiredCallsParser:
    """The generation of tool_choice "required": nothing is content until the whole array is read."""
    name = "json_required"

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        calls = parse_required(text) if final else []
        return ParsedOutput(None if calls else join_content([text]), calls)

    def content_safe_end(self, text: str) -> int:
        return 0


class NamedCallParser:
    """The generation of a tool_choice naming `function_name`: its arguments object, read whole at the end."""
    name = "json_named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        call = parse_named(text, self.function_name) if final else None
        return ParsedOutput(join_content([text]) if call is None else None, [] if call is None else [call])

    def content_safe_end(self, text: str) -> int:
        return 0
