"""How one chat request's tools are served: which parser reads the output, which grammar forces a
call (tool_choice "required" or a named function), and the conversation as the chat template sees it.

A template that renders tools itself (Qwen, Hermes, Llama 3.1, Mistral) gets them as transformers'
`apply_chat_template(tools=...)` passes them, and the history's tool calls and results as they are.
One that does not (the embedded SmolLM2's) gets the tools described in a system message asking for
Hermes `<tool_call>` blocks, earlier calls written as such blocks and results as user messages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.structured_output import StructuredOutput
from server.protocol import ChatCompletionRequest, ChatMessage
from server.tool_calls.constrained import NamedCallParser, RequiredCallsParser
from server.tool_calls.calls import ToolCallParser
from server.tool_calls.hermes import HermesParser
from server.tool_calls.prompt import NO_PARAMETERS, render_tool_calls_as_text, tools_system_prompt
from server.tool_calls.registry import AUTO_PARSER, create_parser, detect_parser, renders_tools

# formats whose markers ([TOOL_CALLS], <|python_tag|>) are special tokens, which decoding must keep
_SPECIAL_MARKER_FORMATS = ("mistral", "llama3_json")
# the most calls a forced turn may make: a small model left an open-ended array repeats its call to the end
MAX_FORCED_CALLS = 8


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools change about serving it."""
    native: bool  # the chat template renders tools and tool calls itself
    parser: ToolCallParser | None = None  # reads tool calls out of the output; None: it is all content
    structured: StructuredOutput | None = None  # the grammar that forces a call
    tools: list[dict] = field(default_factory=list)  # OpenAI's tool objects, for the template or the system prompt
    parallel: bool = True  # parallel_tool_calls: more than one call per turn

    def template_kwargs(self) -> dict:
        return {"tools": self.tools} if self.native and self.tools else {}

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the special tokens kept in the text where the format's markers are some."""
        if self.parser is not None and self.parser.name in _SPECIAL_MARKER_FORMATS:
            return replace(params, skip_special_tokens=False)
        return params


def plan_tool_use(req: ChatCompletionRequest, chat_template: str | None, parser_name: str = AUTO_PARSER) -> ToolUse:
    """The ToolUse of `req`; a ParamError names a tool_choice that cannot be served."""
    native = bool(chat_template) and renders_tools(chat_template)
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise ParamError("tool_choice", "tool_choice needs tools: send the functions the model may call")
    if choice == "none":
        return ToolUse(native)
    if choice == "auto":
        return ToolUse(native, _format_parser(native, chat_template, parser_name), tools=tools,
                       parallel=req.parallel_tool_calls)
    if req.structured_output() is not None:
        raise ParamError("response_format", "a forced tool call (tool_choice 'required' or a named function) "
                                            "already fixes the output's format: drop response_format")
    if choice == "required":
        return ToolUse(native, RequiredCallsParser(), _required_grammar(tools, req.parallel_tool_calls), tools,
                       req.parallel_tool_calls)
    function = _named_function(tools, choice.function.name)
    parameters = function.get("parameters") or NO_PARAMETERS
    return ToolUse(native, NamedCallParser(function["name"]),
                   StructuredOutput("json_schema", json.dumps(parameters), param="tools"), tools, False)


def _format_parser(native: bool, chat_template: str | None, parser_name: str) -> ToolCallParser:
    """The template's own format (or the flag's); Hermes when tandem describes the tools itself."""
    if not native:
        return HermesParser()
    if parser_name == AUTO_PARSER:
        return create_parser(detect_parser(chat_template) or HermesParser.name)
    return create_parser(parser_name)


def _named_function(tools: list[dict], name: str) -> dict:
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool["function"]
    raise ParamError("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools")


def _required_grammar(tools: list[dict], parallel: bool) -> StructuredOutput:
    """A JSON array of calls, each one tool's name with arguments matching that tool's schema."""
    calls = [{"type": "object", "required": ["name", "arguments"],
              "properties": {"name": {"const": tool["function"]["name"]},
                             "arguments": tool["function"].get("parameters") or NO_PARAMETERS}}
             for tool in tools]
    schema = {"type": "array", "minItems": 1, "maxItems": MAX_FORCED_CALLS if parallel else 1,
              "items": {"anyOf": calls}}
    return StructuredOutput("json_schema", json.dumps(schema), param="tools")


def template_messages(messages: list[ChatMessage], tool_use: ToolUse) -> list[dict]:
    """The conversation as the chat template takes it. OpenAI's 'developer' role is what templates
    know as 'system'."""
    conversation = [_template_message(message, tool_use.native) for message in messages]
    if tool_use.tools and not tool_use.native:
        conversation = _with_tools_described(conversation, tool_use.tools)
    return conversation


def _template_message(message: ChatMessage, native: bool) -> dict:
    role = "system" if message.role == "developer" else message.role
    entry = {"role": role, "content": message.text()}
    calls = [call.model_dump() for call in message.tool_calls or []]
    return _native_message(entry, calls, message.tool_call_id) if native else _described_message(entry, calls)


def _native_message(entry: dict, calls: list[dict], tool_call_id: str | None) -> dict:
    """For a template that renders tool calls: arguments as objects (tojson), as transformers documents."""
    if calls:
        entry["tool_calls"] = [{**call, "function": {**call["function"],
                                                     "arguments": _arguments_object(call["function"])}}
                               for call in calls]
    if tool_call_id is not None:
        entry["tool_call_id"] = tool_call_id
    return entry


def _described_message(entry: dict, calls: list[dict]) -> dict:
    """For a template that knows no tools: calls as Hermes blocks, results as a user turn."""
    if calls:
        entry["content"] = "\n".join(part for part in (entry["content"], render_tool_calls_as_text(calls)) if part)
    if entry["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{entry['content']}\n</tool_response>"}
    return entry


def _arguments_object(function: dict) -> object:
    try:
        return json.loads(function["arguments"])
    except json.JSONDecodeError:
        return function["arguments"]


def _with_tools_described(conversation: list[dict], tools: list[dict]) -> list[dict]:
    """The tools' system prompt before the first system message's own text, or as a new first message."""
    prompt = tools_system_prompt(tools)
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        return [{**first, "content": f"{prompt}\n\n{first['content']}"}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]
