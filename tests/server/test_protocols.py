"""The Messages and Responses APIs' translations, without a server: request bodies into chat
requests, a chat.completion body into each protocol's reply, and chat chunks into each protocol's
event stream (whose last events carry what the whole reply says)."""
from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.sampling_params import ParamError
from server.errors import APIError
from server.protocol import parse
from server.protocols import anthropic, responses
from server.protocols.anthropic_stream import MessageStream
from server.protocols.responses_stream import ResponseStream

MODEL = "m"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USAGE = {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47, "prompt_tokens_details": {"cached_tokens": 32}}


def messages_request(**fields) -> anthropic.MessagesRequest:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return parse(anthropic.MessagesRequest, body, anthropic.UNSUPPORTED_PARAMS)


def responses_request(**fields) -> responses.ResponsesRequest:
    return parse(responses.ResponsesRequest, {"model": MODEL, "input": "Hi", **fields}, responses.UNSUPPORTED_PARAMS)


def chat_body(content: str | None, calls: list[dict] | None = None, finish_reason: str = "stop",
              stop_reason: int | str | None = 2) -> dict:
    message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 5, "model": MODEL, "usage": USAGE,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def chat_chunks(texts: list[str], calls: list[dict], finish_reason: str, stop_reason=None) -> list[dict]:
    """What ChatShaper.chunks() yields with include_usage: the role, content deltas, whole calls,
    the finish, the usage."""
    def chunk(choices, **extra):
        return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 5, "model": MODEL,
                "choices": choices, "usage": None, **extra}

    def choice(delta, finish=None):
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}

    chunks = [chunk([choice({"role": "assistant", "content": ""})])]
    chunks += [chunk([choice({"content": text})]) for text in texts]
    chunks += [chunk([choice({"tool_calls": [{"index": i, **call}]})]) for i, call in enumerate(calls)]
    return chunks + [chunk([choice({}, finish_reason)]), chunk([], usage=USAGE)]


def collect(events) -> list[dict]:
    async def run():
        return [event async for event in events]
    return asyncio.run(run())


async def aiter(items):
    for item in items:
        yield item


# ---- Anthropic: requests ------------------------------------------------------------------------
def test_a_conversation_with_tool_use_and_results_becomes_chat_messages():
    req = messages_request(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                           messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    chat = anthropic.chat_request(req)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"}]
    assert (chat.max_tokens, chat.temperature, chat.stream) == (16, 1.0, False)


@pytest.mark.parametrize("tool_choice, chat_choice, parallel", [
    ({"type": "auto"}, "auto", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "none"}, "none", True),
])
def test_tools_and_tool_choice_map_onto_chats(tool_choice, chat_choice, parallel):
    req = messages_request(tools=[{"name": "get_weather", "description": "d", "input_schema": WEATHER_SCHEMA}],
                           tool_choice=tool_choice, stop_sequences=["\n\n"], temperature=0.2, top_k=5,
                           metadata={"user_id": "u"}, thinking={"type": "disabled"})
    chat = anthropic.chat_request(req)
    assert chat.tools[0].function.parameters == WEATHER_SCHEMA
    choice = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    assert (choice, chat.parallel_tool_calls) == (chat_choice, parallel)
    assert (chat.stop, chat.temperature, chat.top_k, chat.user) == (["\n\n"], 0.2, 5, "u")


@pytest.mark.parametrize("fields, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "messages.0.content.0"),
])
def test_what_cannot_be_served_is_a_param_error_naming_it(fields, param):
    with pytest.raises(ParamError) as info:
        anthropic.chat_request(messages_request(**fields))
    assert info.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages.0.content.0.id"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0.content.0"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"max_tokens": None}, "max_tokens"),
])
def test_unsupported_blocks_and_parameters_are_400s_naming_them(fields, param):
    with pytest.raises(APIError) as info:
        messages_request(**fields)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.anthropic_body()["error"]["type"] == "invalid_request_error"


# ---- Anthropic: replies ------------------------------------------------------------------------
@pytest.mark.parametrize("finish_reason, stop_reason, expected", [
    ("stop", 2, ("end_turn", None)), ("stop", "\n\n", ("stop_sequence", "\n\n")), ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None)),
])
def test_stop_reasons(finish_reason, stop_reason, expected):
    assert anthropic.stop_of(finish_reason, stop_reason) == expected


def test_a_chat_reply_becomes_content_blocks_with_anthropics_usage():
    body = anthropic.message_body(chat_body("Let me check.", [CALL], "tool_calls"))
    assert body["id"] == "msg_abc" and body["stop_reason"] == "tool_use"
    assert body["content"] == [{"type": "text", "text": "Let me check."},
                               {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert body["usage"] == {"input_tokens": 8, "output_tokens": 7, "cache_read_input_tokens": 32,
                             "cache_creation_input_tokens": 0}


def accumulate_anthropic(events: list[dict]) -> dict:
    """The message a client builds from the events (as the SDK's accumulator does)."""
    message = events[0]["message"]
    partial_json = {}
    for event in events[1:]:
        if event["type"] == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                partial_json[event["index"]] = partial_json.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop" and event["index"] in partial_json:
            message["content"][event["index"]]["input"] = json.loads(partial_json[event["index"]])
        elif event["type"] == "message_delta":
            message.update(event["delta"])
            message["usage"].update(event["usage"])
    return message


@pytest.mark.parametrize("texts, calls, finish_reason, stop_reason", [
    (["Hel", "lo"], [], "stop", "\n\n"),
    (["Checking."], [CALL, {**CALL, "id": "call_2"}], "tool_calls", None),
    ([], [CALL], "length", None),
])
def test_the_stream_adds_up_to_the_whole_reply(texts, calls, finish_reason, stop_reason):
    events = collect(MessageStream(MODEL, 40).events(aiter(chat_chunks(texts, calls, finish_reason, stop_reason))))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    whole = anthropic.message_body(chat_body("".join(texts) or None, calls, finish_reason, stop_reason))
    streamed = accumulate_anthropic(events)
    assert {key: streamed[key] for key in whole} == whole


# ---- Responses: requests -----------------------------------------------------------------------
def test_input_items_become_chat_messages():
    req = responses_request(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}])
    chat = responses.chat_request(req, MODEL)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]},
        {"role": "tool", "content": "21C", "tool_call_id": "call_1"},
        {"role": "developer", "content": "Answer now."}]


def test_sampling_tools_and_text_format_map_onto_chats():
    req = responses_request(max_output_tokens=9, temperature=0.0, top_p=0.5, parallel_tool_calls=False,
                            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA,
                                    "strict": True}],
                            tool_choice={"type": "function", "name": "get_weather"}, store=False,
                            text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER_SCHEMA}})
    chat = responses.chat_request(req, MODEL)
    assert (chat.model, chat.max_tokens, chat.temperature, chat.top_p, chat.parallel_tool_calls) == \
        (MODEL, 9, 0.0, 0.5, False)
    assert chat.tool_choice.function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER_SCHEMA
    assert chat.response_format.json_schema.json_schema == WEATHER_SCHEMA


@pytest.mark.parametrize("fields, param", [({"store": True}, "store"), ({"previous_response_id": "resp_1"},
                                                                         "previous_response_id")])
def test_stored_state_is_refused_by_name(fields, param):
    with pytest.raises(ParamError) as info:
        responses.chat_request(responses_request(**fields), MODEL)
    assert info.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
])
def test_unsupported_items_and_tools_are_400s_naming_them(fields, param):
    with pytest.raises(APIError) as info:
        responses_request(**fields)
    assert (info.value.status, info.value.param) == (400, param)


# ---- Responses: replies ------------------------------------------------------------------------
def test_a_chat_reply_becomes_output_items_and_usage():
    req = responses_request(max_output_tokens=7)
    chat = chat_body("Checking.", [CALL], "length")
    body = responses.response_body(req, chat, responses.output_items(chat))
    assert (body["id"], body["status"], body["incomplete_details"]) == ("resp_abc", "incomplete",
                                                                        {"reason": "max_output_tokens"})
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Checking."
    assert (body["output"][1]["call_id"], body["output"][1]["arguments"]) == ("call_1", '{"city": "Paris"}')
    assert body["usage"] == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 7,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 47}


@pytest.mark.parametrize("texts, calls, finish_reason", [
    (["Hel", "lo"], [], "stop"), (["Checking."], [CALL, {**CALL, "id": "call_2"}], "tool_calls"), ([], [CALL], "length"),
])
def test_the_response_stream_ends_with_the_whole_response(texts, calls, finish_reason):
    req = responses_request()
    events = collect(ResponseStream(req).events(aiter(chat_chunks(texts, calls, finish_reason))))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    chat = chat_body("".join(texts) or None, calls, finish_reason)
    whole = responses.response_body(req, chat, responses.output_items(chat))
    assert events[-1]["type"] == ("response.incomplete" if finish_reason == "length" else "response.completed")
    assert events[-1]["response"] == whole
    done_items = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done_items == whole["output"]
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text == "".join(texts)
