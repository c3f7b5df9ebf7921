"""Tool calling for chat templates that know nothing of tools: the functions described in a system
message that asks for Hermes `<tool_call>` blocks (so that the hermes parser reads the answer), and
an assistant message's earlier tool calls written back as such blocks for the conversation history."""
from __future__ import annotations

import json
from typing import Any

from server.tool_calls.hermes import CLOSE_TAG, OPEN_TAG

# the schema of a function that takes no arguments, for a tool given without "parameters"
NO_PARAMETERS = {"type": "object", "properties": {}}


def tools_system_prompt(tools: list[dict]) -> str:
    """The system-message text listing `tools` (OpenAI's shape, {"type": "function", "function": {...}})
    as one JSON object per line inside <tools></tools>, and how to call them."""
    functions = "\n".join(json.dumps(_function_description(tool), ensure_ascii=False) for tool in tools)
    return ("You can call functions to help you answer. Each line between <tools> and </tools> describes one "
            "function: its name, what it does, and the JSON schema of its arguments.\n"
            f"<tools>\n{functions}\n</tools>\n\n"
            f"To call a function, write its name and arguments as one JSON object between {OPEN_TAG} and "
            f"{CLOSE_TAG}, like this:\n"
            f'{OPEN_TAG}\n{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}\n{CLOSE_TAG}\n'
            "Write one such block per call; you may call several functions at once. "
            "When no function is needed, answer in plain text.")


def render_tool_calls_as_text(tool_calls: list[dict]) -> str:
    """An assistant message's `tool_calls` (OpenAI's shape, arguments a JSON string) as Hermes blocks,
    one per line. Arguments that are no valid JSON are written as the string they are."""
    blocks = []
    for tool_call in tool_calls:
        function = tool_call["function"]
        call = {"name": function["name"], "arguments": _arguments_value(function.get("arguments"))}
        blocks.append(f"{OPEN_TAG}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE_TAG}")
    return "\n".join(blocks)


def _function_description(tool: dict) -> dict:
    function = tool.get("function", tool)
    description = {"name": function["name"]}
    if function.get("description"):
        description["description"] = function["description"]
    description["parameters"] = function.get("parameters") or NO_PARAMETERS
    return description


def _arguments_value(arguments: Any) -> Any:
    """The arguments as the JSON value they encode; an absent or empty value is no arguments."""
    if not arguments:
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
