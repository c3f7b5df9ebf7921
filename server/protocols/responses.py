"""OpenAI's Responses API, stateless: its request bodies, their translation into a chat request, and
a chat.completion body translated back into a response object.

`instructions` becomes the first system message; input messages become chat messages, function_call
items an assistant message's tool_calls and function_call_output items tool messages; text.format is
response_format. Nothing is stored: `store: true` and `previous_response_id` are refused by name, and
a client sends the conversation as input items, as the Agents SDK and Codex-style clients do."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field

from scheduler.sampling_params import ParamError
from server import protocol
from server.protocol import ChatCompletionRequest, StrictBody, tagged_union

PARAM_RENAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
                 "response_format": "text.format", "response_format.json_schema": "text.format.schema"}
UNSUPPORTED_PARAMS = {"background": "background responses", "conversation": "stored conversations",
                      "prompt": "stored prompts", "reasoning": "reasoning settings",
                      "max_tool_calls": "a limit on built-in tool calls", "top_logprobs": "logprobs"}
STATUS = Literal["in_progress", "completed", "incomplete"]
ID_PREFIX = "resp_"


class InputText(StrictBody):
    type: Literal["input_text"]
    text: str


class OutputText(StrictBody):
    """An assistant's text from an earlier response, sent back as it came."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


ContentPart = tagged_union(InputText, OutputText)


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: str | None = None
    status: STATUS | None = None


class FunctionCallItem(StrictBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: STATUS | None = None


class FunctionCallOutputItem(StrictBody):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]
    id: str | None = None
    status: STATUS | None = None


# a message item may leave out its type (EasyInputMessage)
InputItem = tagged_union(MessageItem, FunctionCallItem, FunctionCallOutputItem, default="message")


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictBody):
    type: Literal["function"]
    name: str


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictBody):
    format: TextFormat | None = None


class ResponsesRequest(StrictBody):
    """POST /v1/responses."""
    model: str | None = None
    input: Union[str, list[InputItem]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # only false: nothing is stored
    previous_response_id: str | None = None  # refused: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # the context is never cut to fit
    include: list[str] | None = Field(default=None, max_length=0)  # no extra output to include
    prompt_cache_key: str | None = None  # the prefix cache finds repeated prompts by itself


def chat_request(req: ResponsesRequest, model_name: str) -> ChatCompletionRequest:
    """The chat request that serves `req`; a ParamError names what cannot be served."""
    if req.store:
        raise ParamError("store", "this server stores no responses: send store false and the whole "
                                  "conversation as input items")
    if req.previous_response_id is not None:
        raise ParamError("previous_response_id", "this server stores no responses: send the whole "
                                                 "conversation as input items")
    body: dict[str, Any] = {"model": model_name, "messages": chat_messages(req), "stream": req.stream,
                            "max_tokens": req.max_output_tokens, "user": req.user}
    optional = {"temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls}
    body.update({name: value for name, value in optional.items() if value is not None})
    if req.tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                       "function": {"name": choice.name}}
    if req.text is not None and req.text.format is not None:
        body["response_format"] = _response_format(req.text.format)
    if req.stream:  # the last chunk's usage fills response.completed's
        body["stream_options"] = {"include_usage": True}
    return protocol.parse(ChatCompletionRequest, body)


def _response_format(text_format: TextFormat) -> dict:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    json_schema = {"name": text_format.name or "response", "strict": text_format.strict}
    if text_format.json_schema is not None:
        json_schema["schema"] = text_format.json_schema
    return {"type": "json_schema", "json_schema": json_schema}


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """The input items as chat messages; a run of function_call items joins the assistant message
    before it (a response's text and its calls are one turn)."""
    messages = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: Union[str, list]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


# ---- the reply ---------------------------------------------------------------------------------
def response_id(chat_id: str) -> str:
    return ID_PREFIX + chat_id.partition("-")[2]


def message_item(base_id: str, output_index: int, text: str, status: str = "completed") -> dict:
    return {"id": f"msg_{base_id}_{output_index}", "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)] if status == "completed" else []}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(base_id: str, output_index: int, call: dict, status: str = "completed") -> dict:
    function = call["function"]
    return {"id": f"fc_{base_id}_{output_index}", "type": "function_call", "status": status, "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"] if status == "completed" else ""}


def output_items(chat: dict) -> list[dict]:
    """A chat.completion's message as output items: its text as a message, then each call."""
    base_id, message = chat["id"].partition("-")[2], chat["choices"][0]["message"]
    items = [message_item(base_id, 0, message["content"])] if message["content"] else []
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(base_id, len(items), call))
    return items


def response_body(req: ResponsesRequest, chat: dict, output: list[dict]) -> dict:
    """The response object: `output` items, status and usage from the chat.completion `chat`, the
    request's settings echoed. A chat without usage (response.created's) is in progress."""
    choice = chat["choices"][0] if chat["choices"] else {"finish_reason": None}
    status = {None: "in_progress", "length": "incomplete"}.get(choice["finish_reason"], "completed")
    return {
        "id": response_id(chat["id"]), "object": "response", "created_at": chat["created"], "model": chat["model"],
        "status": status, "error": None, "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": _tool_choice(req), "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                 if req.text and req.text.format else {"type": "text"}},
        "metadata": req.metadata or {}, "store": False, "previous_response_id": None, "truncation": "disabled",
        "user": req.user, "usage": usage(chat["usage"]) if chat.get("usage") else None,
    }


def _tool_choice(req: ResponsesRequest) -> str | dict:
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
