"""tandem's constrained formats, generated when the server forces a tool call with a grammar: for
tool_choice "required" the generation is a JSON array of `{"name": ..., "arguments": {...}}` objects,
for a named function it is that function's arguments object alone. The grammar leaves no room for
content, so none is ever returned: a generation cut off by max_tokens answers with the calls it
completed before the cut (none for a named function whose object is unfinished), never its raw JSON.
The two parser classes let ToolCallStream stream these generations like any other format; a forced
array's calls are sent as each one is followed by `,` or `]`."""
from __future__ import annotations

import json

from server.tool_calls.calls import ParsedOutput, ToolCall, arguments_text, call_from_object, decode_object_at


def parse_required(text: str, *, final: bool = True) -> list[ToolCall]:
    """The calls of a JSON array of call objects, up to the first entry that is unfinished or no call.
    final=False: only the entries a `,` or `]` follows, which no continuation can change."""
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        return []
    calls, position = [], position + 1
    while (decoded := decode_object_at(text, position)) is not None:
        call = call_from_object(decoded[0])
        position = _skip_space(text, decoded[1])
        closed = text.startswith((",", "]"), position)
        if call is None or not (closed or final):
            break
        calls.append(call)
        if not text.startswith(",", position):
            break
        position += 1
    return calls


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def parse_named(text: str, name: str) -> ToolCall | None:
    """The call of function `name` whose arguments object is the whole text; None when it is no object."""
    try:
        arguments = arguments_text(json.loads(text))
    except json.JSONDecodeError:
        return None
    return None if arguments is None else ToolCall(name, arguments)


class RequiredCallsParser:
    """The generation of tool_choice "required": calls only, never content."""
    name = "json_required"

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        return ParsedOutput(None, parse_required(text, final=final))

    def content_safe_end(self, text: str) -> int:
        return 0


class NamedCallParser:
    """The generation of a tool_choice naming `function_name`: its arguments object, read whole at the end;
    never content."""
    name = "json_named"

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        call = parse_named(text, self.function_name) if final else None
        return ParsedOutput(None, [] if call is None else [call])

    def content_safe_end(self, text: str) -> int:
        return 0
