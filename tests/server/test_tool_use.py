"""A chat request's tools planned against chat templates: which parser reads the output, which
grammar forces a call, how the history reaches a template that renders tools and one that does not,
and the refusals. No server: the templates are the small family look-alikes of test_tool_parsers."""
from __future__ import annotations

import json

import jsonschema
import pytest

from scheduler.sampling_params import ParamError, SamplingParams
from server.protocol import ChatCompletionRequest
from server.tool_calls.tool_use import MAX_FORCED_CALLS, plan_tool_use, template_messages
from test_tool_parsers import LLAMA31_LIKE, MISTRAL_LIKE, PLAIN, QWEN_LIKE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [WEATHER, NOW], **fields})


@pytest.mark.parametrize("template, flag, parser, keeps_special", [
    (QWEN_LIKE, "auto", "hermes", False), (MISTRAL_LIKE, "auto", "mistral", True),
    (LLAMA31_LIKE, "auto", "llama3_json", True), (QWEN_LIKE, "mistral", "mistral", True),
    (PLAIN, "mistral", "hermes", False),  # tandem describes the tools itself, in Hermes' format
])
def test_auto_reads_the_templates_format_unless_the_flag_says_otherwise(template, flag, parser, keeps_special):
    tool_use = plan_tool_use(request(), template, flag)
    assert tool_use.parser.name == parser and tool_use.structured is None
    assert tool_use.sampling_params(SamplingParams()).skip_special_tokens is not keeps_special


def test_a_template_that_renders_tools_gets_them_and_the_history_as_is():
    tool_use = plan_tool_use(request(), QWEN_LIKE)
    assert tool_use.template_kwargs() == {"tools": [WEATHER, NOW]}
    system, user, assistant, tool = template_messages(request().messages, tool_use)
    assert system == {"role": "system", "content": "Be brief."}
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object, for tojson
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_a_template_without_tools_gets_them_described_and_the_history_as_text():
    tool_use = plan_tool_use(request(), PLAIN)
    assert tool_use.template_kwargs() == {}
    system, user, assistant, tool = template_messages(request().messages, tool_use)
    assert system["content"].endswith("\n\nBe brief.") and '"name": "get_weather"' in system["content"]
    assert assistant == {"role": "assistant",
                         "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert tool == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_tool_choice_none_renders_no_tools_and_reads_no_calls():
    tool_use = plan_tool_use(request(tool_choice="none"), PLAIN)
    assert tool_use.parser is None and tool_use.structured is None
    assert template_messages(request().messages, tool_use)[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("parallel, max_items", [(True, MAX_FORCED_CALLS), (False, 1)])
def test_required_forces_an_array_of_calls_each_matching_its_tool(parallel, max_items):
    tool_use = plan_tool_use(request(tool_choice="required", parallel_tool_calls=parallel), PLAIN)
    schema = json.loads(tool_use.structured.spec)
    assert tool_use.structured.param == "tools" and schema["maxItems"] == max_items
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now", "arguments": {}}],
                        {**schema, "maxItems": 2})
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "other", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)

def test_a_named_function_forces_its_arguments_object():
    tool_use = plan_tool_use(request(tool_choice={"type": "function", "function": {"name": "get_weather"}}), PLAIN)
    assert json.loads(tool_use.structured.spec) == WEATHER["function"]["parameters"]
    call, = tool_use.parser.parse('{"city": "Rome"}').tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})


@pytest.mark.parametrize("fields, param", [
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_choices_that_cannot_be_served_name_the_field(fields, param):
    with pytest.raises(ParamError) as caught:
        plan_tool_use(request(**fields), PLAIN)
    assert caught.value.param == param
