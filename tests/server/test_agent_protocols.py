"""The anthropic and openai SDKs against `tandem serve` through /v1/messages and /v1/responses: text
with a system prompt, streamed replies equal to whole ones, forced tool use whose arguments match the
tool's schema, tool results round-tripping, an agent loop of several tool turns, count_tokens, the
prefix cache in usage, a forced call cut short by the token budget in all three protocols, the error
shapes, and the requests counted by endpoint. Marked api (`make test-api`): the embedded model
generates, greedy and short."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tandem_server import MODEL, REQUEST_TIMEOUT_S, metric, scrape

pytestmark = pytest.mark.api

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                               "b": {"type": "integer", "minimum": -999, "maximum": 999}},
              "required": ["a", "b"]}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
ANTHROPIC_TOOLS = [{"name": name, "description": description, "input_schema": SCHEMAS[name]}
                   for name, description in (("get_weather", "The current weather in a city"),
                                             ("add", "Add two integers"))]
RESPONSES_TOOLS = [{"type": "function", "name": tool["name"], "description": tool["description"],
                    "parameters": tool["input_schema"], "strict": True} for tool in ANTHROPIC_TOOLS]
QUESTION = "What is the weather in Paris, and what is 2 + 3?"
GREEDY = {"temperature": 0}
MAX_TOKENS = 24
# room for a forced turn's calls: at most ~50 tokens each, and greedy decoding makes two
FORCED_MAX_TOKENS = 128
# a forced turn cut inside its second call (greedy: each call of `add` takes ~23 tokens)
CUT_MAX_TOKENS = 32
TOOL_RESULTS = {"get_weather": '{"temperature": 21, "sky": "sunny"}', "add": "5"}


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def responses_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def message(claude, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "Say hello."}],
              **kwargs}
    return claude.messages.create(**kwargs, extra_body=GREEDY)


def streamed_response(client, **kwargs):
    """The whole response of a streamed request: response.completed's, or response.incomplete's."""
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[0].type == "response.created" and [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def validate(name: str, arguments: dict) -> None:
    jsonschema.validate(arguments, SCHEMAS[name])


# ---- text ---------------------------------------------------------------------------------------
def test_messages_text_with_a_system_prompt_streamed_equals_whole(claude):
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": "You are a terse pirate.",
               "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]}
    whole = claude.messages.create(**request, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.content[0].type == "text"
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
    with claude.messages.stream(**request, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [block.text for block in streamed.content] == [block.text for block in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    # the second request found the prompt in the prefix cache; the input counts add up either way
    assert streamed.usage.cache_read_input_tokens > 0
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_responses_text_with_instructions_streamed_equals_whole(responses_client):
    request = {"model": MODEL, "instructions": "You are a terse pirate.", "input": "Say hello.",
               "max_output_tokens": MAX_TOKENS, "temperature": 0, "store": False}
    whole = responses_client.responses.create(**request)
    assert whole.object == "response" and whole.output_text and whole.status in ("completed", "incomplete")
    streamed = streamed_response(responses_client, **request)
    assert (streamed.output_text, streamed.status) == (whole.output_text, whole.status)
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens_details.cached_tokens > 0


def test_stop_sequences_end_a_message(claude):
    whole = message(claude, max_tokens=64, messages=[{"role": "user", "content": "Count from 1 to 9 with commas."}])
    stop = whole.content[0].text[2:4]  # a piece the greedy answer writes
    stopped = message(claude, max_tokens=64, stop_sequences=[stop],
                      messages=[{"role": "user", "content": "Count from 1 to 9 with commas."}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)


# ---- tools --------------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "add"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_matches_the_schema_streamed_or_not(claude, tool_choice):
    request = {"model": MODEL, "max_tokens": FORCED_MAX_TOKENS, "tools": ANTHROPIC_TOOLS, "tool_choice": tool_choice,
               "messages": [{"role": "user", "content": QUESTION}]}
    whole = claude.messages.create(**request, extra_body=GREEDY)
    assert whole.stop_reason == "tool_use"
    calls = [block for block in whole.content if block.type == "tool_use"]
    assert calls and all(validate(call.name, call.input) is None for call in calls)
    if tool_choice["type"] == "tool":
        assert [call.name for call in calls] == ["add"]
    if tool_choice.get("disable_parallel_tool_use"):
        assert len(calls) == 1
    with claude.messages.stream(**request, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(b.name, b.input) for b in whole.content]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_calls_match_the_schema_streamed_or_not(responses_client, tool_choice):
    request = {"model": MODEL, "input": QUESTION, "tools": RESPONSES_TOOLS, "tool_choice": tool_choice,
               "max_output_tokens": FORCED_MAX_TOKENS, "temperature": 0}
    whole = responses_client.responses.create(**request)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and calls
    for call in calls:
        assert call.call_id.startswith("call_")
        validate(call.name, json.loads(call.arguments))
    streamed = streamed_response(responses_client, **request)
    assert [(i.name, i.arguments) for i in streamed.output] == [(i.name, i.arguments) for i in whole.output]


def run_tool_uses(content) -> list[dict]:
    return [{"type": "tool_result", "tool_use_id": block.id, "content": TOOL_RESULTS[block.name]}
            for block in content if block.type == "tool_use"]


def test_an_anthropic_agent_loop_of_several_tool_turns(claude):
    """Each turn's tool_use answered by tool_result blocks, the last turn free to answer in text."""
    messages = [{"role": "user", "content": QUESTION}]
    for tool_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
        reply = claude.messages.create(model=MODEL, max_tokens=FORCED_MAX_TOKENS, tools=ANTHROPIC_TOOLS,
                                       tool_choice=tool_choice, messages=messages, extra_body=GREEDY)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": run_tool_uses(reply.content)})
    assert len(messages) >= 5  # two tool turns at least, results included
    assert reply.content and reply.stop_reason in ("tool_use", "end_turn", "max_tokens")
    count = claude.messages.count_tokens(model=MODEL, tools=ANTHROPIC_TOOLS, messages=messages[:-1])
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def test_a_responses_agent_loop_of_several_tool_turns(responses_client):
    """Each turn's function_call items answered by function_call_output items."""
    items: list = [{"role": "user", "content": QUESTION}]
    for tool_choice in ("required", {"type": "function", "name": "add"}, "auto"):
        response = responses_client.responses.create(model=MODEL, input=items, tools=RESPONSES_TOOLS,
                                                     tool_choice=tool_choice, max_output_tokens=FORCED_MAX_TOKENS,
                                                     temperature=0)
        calls = [item for item in response.output if item.type == "function_call"]
        items += [item.model_dump(exclude_none=True) for item in response.output]
        if not calls:
            break
        items += [{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULTS[call.name]}
                  for call in calls]
    assert sum(item["type"] == "function_call_output" for item in items if "type" in item) >= 2
    assert response.output


def test_count_tokens_is_what_the_message_prompts(claude):
    request = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi there"}]}
    count = claude.messages.count_tokens(**request)
    reply = claude.messages.create(**request, max_tokens=1)
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0


# ---- a forced call cut short --------------------------------------------------------------------
def test_a_forced_call_cut_short_answers_with_the_calls_before_the_cut(client, claude, responses_client):
    """Greedy, the embedded model calls `add` twice; a budget that ends inside the second call leaves
    the first as the reply's call in each protocol, never the grammar's raw JSON as text."""
    question = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=CUT_MAX_TOKENS,
                                          tools=[{"type": "function", "function": {"name": t["name"],
                                                  "parameters": t["parameters"]}} for t in RESPONSES_TOOLS],
                                          tool_choice="required").choices[0]
    assert (chat.finish_reason, chat.message.content, len(chat.message.tool_calls)) == ("length", None, 1)
    validate(chat.message.tool_calls[0].function.name, json.loads(chat.message.tool_calls[0].function.arguments))
    reply = claude.messages.create(model=MODEL, max_tokens=CUT_MAX_TOKENS, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "any"}, messages=question, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and [block.type for block in reply.content] == ["tool_use"]
    response = responses_client.responses.create(model=MODEL, input=question, tools=RESPONSES_TOOLS,
                                                 tool_choice="required", max_output_tokens=CUT_MAX_TOKENS,
                                                 temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["function_call"]


# ---- errors and metrics -------------------------------------------------------------------------
@pytest.mark.parametrize("change, status, fragment", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     400, "image"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"model": "not-served"}, 404, "not-served"),
])
def test_messages_errors_are_in_anthropics_shape(http, claude, change, status, fragment):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **change}
    response = http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert set(error["error"]) == {"type", "message"} and fragment in error["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as raised:
        claude.messages.create(**body)
    assert raised.value.status_code == status and raised.value.body["error"]["type"] == error["error"]["type"]


@pytest.mark.parametrize("change, param", [({"store": True}, "store"), ({"previous_response_id": "resp_1"},
                                                                         "previous_response_id"),
                                           ({"input": [{"type": "reasoning", "summary": []}]}, "input.0")])
def test_responses_errors_are_openai_shaped_and_name_the_field(responses_client, change, param):
    with pytest.raises(openai.BadRequestError) as raised:
        responses_client.responses.create(**{"model": MODEL, "input": "Hi", **change})
    assert raised.value.body["param"] == param


def test_requests_are_counted_by_endpoint(http, claude, responses_client):
    before = scrape(http)
    message(claude, max_tokens=1)
    responses_client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    http.post("/v1/messages", json={"model": MODEL, "messages": []})
    after = scrape(http)
    for endpoint, status in (("/v1/messages", "200"), ("/v1/responses", "200"), ("/v1/messages", "400")):
        counted = metric(after, "api_requests_total", endpoint=endpoint, status=status)
        assert counted == metric(before, "api_requests_total", endpoint=endpoint, status=status) + 1
