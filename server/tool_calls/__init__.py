"""OpenAI tool calls out of a model's generated text, whole or streamed, in the formats the model
families write them (hermes, llama3_json, mistral) and in tandem's grammar-forced JSON; and the
prompt text for chat templates that cannot describe tools themselves."""
from server.tool_calls.calls import ParsedOutput, ToolCall, ToolCallParser, new_call_id
from server.tool_calls.constrained import NamedCallParser, RequiredCallsParser, parse_named, parse_required
from server.tool_calls.prompt import render_tool_calls_as_text, tools_system_prompt
from server.tool_calls.registry import PARSER_NAMES, PARSERS, create_parser, detect_parser
from server.tool_calls.streaming import StreamDelta, ToolCallStream

__all__ = [
    "PARSERS", "PARSER_NAMES", "NamedCallParser", "ParsedOutput", "RequiredCallsParser", "StreamDelta", "ToolCall",
    "ToolCallParser", "ToolCallStream", "create_parser", "detect_parser", "new_call_id", "parse_named",
    "parse_required", "render_tool_calls_as_text", "tools_system_prompt",
]
