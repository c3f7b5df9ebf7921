"""The openai SDK against `tandem serve` on the embedded model: response_format JSON schemas whose
outputs jsonschema validates (greedy and 20 seeded samples, streamed and not), forced tool calls
whose arguments validate against each tool's schema, streamed tool-call deltas reassembling to the
whole response, tool results round-tripping through the chat template, and the 400s.
Marked api (`make test-api`): a minute of generation, kept out of `make test`'s time."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from server.protocol import ChatCompletionRequest
from server.routes.shared import render_chat
from server.tool_calls.tool_use import MAX_FORCED_CALLS, plan_tool_use
from json_schemas import PERSON_SCHEMA  # tests/ is on sys.path through tests/conftest.py
from tandem_server import MODEL, assert_openai_error

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
PERSON_MESSAGES = [{"role": "user", "content": "Describe a person as JSON with name, age, tags and address."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
pytestmark = pytest.mark.api

MAX_TOKENS = 160
# room for the most calls a forced turn may make, each at most ~50 tokens (a 30-character city spelled a
# character a token, plus the call's JSON): a forced turn always completes
FORCED_MAX_TOKENS = 64 * MAX_FORCED_CALLS


def person(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=PERSON_MESSAGES, response_format=PERSON_FORMAT,
                                          max_tokens=MAX_TOKENS, **kwargs)


def streamed_text(stream) -> tuple[str, str]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].choices[0].finish_reason


def test_json_schema_greedy_validates_streamed_or_not(client):
    whole = person(client, temperature=0)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON_SCHEMA)
    text, finish_reason = streamed_text(person(client, temperature=0, stream=True))
    assert (text, finish_reason) == (whole.choices[0].message.content, "stop")


def test_json_schema_seeded_samples_validate(client):
    def sample(seed: int) -> str:
        if seed % 4 == 0:  # a share of them streamed
            text, finish_reason = streamed_text(person(client, temperature=1.0, seed=seed, stream=True))
        else:
            choice = person(client, temperature=1.0, seed=seed).choices[0]
            text, finish_reason = choice.message.content, choice.finish_reason
        assert finish_reason == "stop", text
        return text

    with ThreadPoolExecutor(max_workers=20) as pool:  # together, so the engine batches them
        texts = list(pool.map(sample, range(20)))
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one greedy answer twenty times


def test_json_object_and_completions_response_format(client):
    question = [{"role": "user", "content": "Answer the question: is the sky blue?"}]
    chat = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=MAX_TOKENS,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(model=MODEL, prompt="The answer, yes or no:", temperature=0,
                                           max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert completion.choices[0].text in ("yes", "no")


def test_uncompilable_schema_is_a_400_naming_response_format(http):
    body = {"model": MODEL, "messages": PERSON_MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}
    error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, "response_format")
    assert "nonsense" in error["message"]


def validate_calls(tool_calls, names=None) -> list[str]:
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    called = [call.function.name for call in tool_calls]
    assert not names or called == names
    return called


def test_required_tool_choice_validates_against_each_tools_schema(client):
    def call(kwargs: dict):
        return client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS,
                                              tool_choice="required", max_tokens=FORCED_MAX_TOKENS, **kwargs)

    with ThreadPoolExecutor(max_workers=5) as pool:
        outs = list(pool.map(call, [{"temperature": 0}, *({"temperature": 1.0, "seed": seed} for seed in range(4))]))
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert 1 <= len(validate_calls(choice.message.tool_calls)) <= MAX_FORCED_CALLS


def test_named_tool_choice_and_parallel_tool_calls_false(client):
    named = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=MAX_TOKENS)
    validate_calls(named.choices[0].message.tool_calls, ["add"])
    single = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, temperature=0.8,
                                            seed=3, tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=FORCED_MAX_TOKENS)
    assert len(single.choices[0].message.tool_calls) == 1


def reassembled_calls(stream) -> tuple[list[tuple[str, str]], str]:
    """The tool calls of a stream as the SDK's users reassemble them: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in stream:
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta_call.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or delta_call.id
            call["name"] += (delta_call.function.name or "") if delta_call.function else ""
            call["arguments"] += (delta_call.function.arguments or "") if delta_call.function else ""
        finish_reason = chunk.choices[0].finish_reason if chunk.choices else finish_reason
    assert all(call["id"] for call in calls.values())
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], finish_reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_to_the_whole_response(client, tool_choice):
    request = dict(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                   max_tokens=FORCED_MAX_TOKENS)
    whole = client.chat.completions.create(**request).choices[0]
    streamed, finish_reason = reassembled_calls(client.chat.completions.create(**request, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert finish_reason == whole.finish_reason == "tool_calls"


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'},
]


def test_tool_results_round_trip_through_the_template(client, server):
    from engine.text import Tokenizer
    from engine.weights import embedded_gguf_path
    tokenizer = Tokenizer.from_source(embedded_gguf_path())
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": HISTORY, "tools": TOOLS})
    prompt = tokenizer.decode(render_chat(tokenizer, request.messages, True,
                                          plan_tool_use(request, tokenizer.chat_template)))
    # the embedded template renders no tools: the call goes back as a Hermes block, the result as a response
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in prompt
    assert '"name": "add"' in prompt  # the tools are described in the system message
    answer = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, temperature=0,
                                            max_tokens=24)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
])
def test_tool_and_format_errors_name_the_field(http, change, param):
    body = {"model": MODEL, "messages": WEATHER_QUESTION, "max_tokens": 4, **change}
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_sdk_raises_bad_request_for_an_unknown_tool(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
