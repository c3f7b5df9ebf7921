"""Anthropic's Messages API: its request bodies, their translation into a chat request, and a
chat.completion body translated back into a Message.

A system prompt and system messages become system messages; text blocks become text, an assistant's
tool_use blocks its tool_calls and a user's tool_result blocks tool messages. Blocks tandem cannot
serve (images, documents, thinking, server tools) are refused by name; cache_control is accepted and
needs nothing, as the prefix cache finds repeated prompts by itself."""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import Field

from scheduler.sampling_params import ParamError
from server import protocol
from server.protocol import ChatCompletionRequest, StrictBody, tagged_union

# engine and chat field names -> the Messages API's, for a ParamError's 400
PARAM_RENAMES = {"prompt": "messages", "stop": "stop_sequences", "response_format": "output_config.format"}
UNSUPPORTED_PARAMS = {"container": "code execution containers", "mcp_servers": "MCP servers",
                      "context_management": "context management", "diagnostics": "cache diagnostics"}
ID_PREFIX = "msg_"


class CacheControl(StrictBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None  # a reply's text blocks sent back as they came


class ToolUseBlock(StrictBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


ContentBlock = tagged_union(TextBlock, ToolUseBlock, ToolResultBlock)


class InputMessage(StrictBody):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]


class ToolDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")  # what a chat function's name may be
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoiceAuto(StrictBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(StrictBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(StrictBody):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(StrictBody):
    type: Literal["none"]


ToolChoice = tagged_union(ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone)


class JSONOutputFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    format: JSONOutputFormat | None = None
    effort: str | None = None  # refused: tandem's models have no effort setting


class Metadata(StrictBody):
    user_id: str | None = None


class CountTokensRequest(StrictBody):
    """POST /v1/messages/count_tokens: what a Messages request's prompt holds."""
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"} is served
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Older clients send the sampling fields in the body (the current SDK
    through extra_body)."""
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: either is served


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves `req`; a ParamError names what cannot be served."""
    _refuse_what_is_not_served(req)
    body = {"model": req.model, "messages": _chat_messages(req), **_chat_tools(req)}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.json_schema}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stop=req.stop_sequences, stream=req.stream)
        if req.stream:  # the last chunk's usage fills message_delta's
            body["stream_options"] = {"include_usage": True}
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
    return protocol.parse(ChatCompletionRequest, body)


def _refuse_what_is_not_served(req: CountTokensRequest) -> None:
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        raise ParamError("thinking", "extended thinking is not supported by this server")
    if req.output_config is not None and req.output_config.effort is not None:
        raise ParamError("output_config.effort", "output_config.effort is not supported by this server")


def _chat_tools(req: CountTokensRequest) -> dict:
    """tools, tool_choice and parallel_tool_calls as chat takes them."""
    fields: dict[str, Any] = {}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description else {})}} for tool in req.tools]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.type != "none":
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _chat_messages(req: CountTokensRequest) -> list[dict]:
    messages = [] if req.system is None else [{"role": "system", "content": _text(req.system)}]
    for index, message in enumerate(req.messages):
        where = f"messages.{index}.content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_message(message.content, where))
        else:
            messages.extend(_user_messages(message.role, message.content, where))
    return messages


def _text(content: Union[str, list[TextBlock]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content)


def _assistant_message(blocks: list, where: str) -> dict:
    """Text blocks as the content, tool_use blocks as the tool_calls."""
    texts, calls = [], []
    for number, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            raise ParamError(f"{where}.{number}", "tool_result blocks belong in user messages")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    message = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(role: str, blocks: list, where: str) -> list[dict]:
    """Each tool_result block a tool message; the text between them one message of `role`."""
    messages, texts = [], []
    for number, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if isinstance(block, ToolUseBlock) or role == "system":
            raise ParamError(f"{where}.{number}", f"{block.type} blocks do not belong in {role} messages")
        if texts:
            messages.append({"role": role, "content": "".join(texts)})
            texts = []
        result = _text(block.content)
        messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": f"Error: {result}" if block.is_error else result})
    if texts or not messages:
        messages.append({"role": role, "content": "".join(texts)})
    return messages


# ---- the reply ---------------------------------------------------------------------------------
def message_body(chat: dict) -> dict:
    """A chat.completion body (one choice) as a Messages API reply."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message["content"] else []
    content += [tool_use_block(call) for call in message.get("tool_calls") or []]
    stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice.get("stop_reason"))
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(chat["usage"])}


def message_id(chat_id: str) -> str:
    return ID_PREFIX + chat_id.partition("-")[2]


def tool_use_block(call: dict) -> dict:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"], "input": json.loads(function["arguments"])}


def stop_of(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and the stop string or token that
    ended it."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def usage(chat_usage: dict) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from the rest."""
    num_cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat_usage["prompt_tokens"] - num_cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_read_input_tokens": num_cached, "cache_creation_input_tokens": 0}
