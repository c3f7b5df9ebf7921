"""The Hermes format (Hermes 2 Pro, Qwen 2.5 and 3, and tandem's own fallback): each call is a JSON
object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, with any text
before, between or after the blocks being content."""
from __future__ import annotations

from server.tool_calls.calls import ParsedOutput, ToolCall, call_from_json, join_content, marker_safe_end

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesParser:
    name = "hermes"

    def parse(self, text: str, *, final: bool = True) -> ParsedOutput:
        """Blocks whose JSON is no call stay content, tags included. A last block the generation
        ended inside (no closing tag, as when a model stops right after the JSON) counts when final."""
        content: list[str] = []
        calls: list[ToolCall] = []
        position = 0
        while (start := text.find(OPEN_TAG, position)) >= 0:
            content.append(text[position:start])
            body_start = start + len(OPEN_TAG)
            close = text.find(CLOSE_TAG, body_start)
            if close < 0 and not final:  # more text may still close it
                position = start
                break
            body_end = len(text) if close < 0 else close
            block_end = len(text) if close < 0 else close + len(CLOSE_TAG)
            call = call_from_json(text[body_start:body_end])
            if call is None:
                content.append(text[start:block_end])
            else:
                calls.append(call)
            position = block_end
        content.append(text[position:])
        return ParsedOutput(join_content(content), calls)

    def content_safe_end(self, text: str) -> int:
        return marker_safe_end(text, OPEN_TAG)
