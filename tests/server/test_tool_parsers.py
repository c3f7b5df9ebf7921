"""server.tool_calls without a server: each format's parser on canned generations, the stream adding
up to the whole parse for every chunking, the choice of a parser from chat templates, and the
system prompt and history rendering read back by the hermes parser."""
from __future__ import annotations

import json
import random
import re

import pytest

from server.tool_calls import (PARSER_NAMES, NamedCallParser, RequiredCallsParser, StreamDelta, ToolCallParser,
                               ToolCallStream, create_parser, detect_parser, parse_named, parse_required,
                               render_tool_calls_as_text, tools_system_prompt)
from server.tool_calls.prompt import NO_PARAMETERS

RANDOM_CALL_ID = re.compile(r"call_[0-9a-f]{24}")
NUM_RANDOM_CHUNKINGS = 3
MAX_RANDOM_CHUNK = 7

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# (parser, case, generated text, expected content, expected calls as (name, arguments object))
CASES = [
    ("hermes", "single", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    ("hermes", "parallel, spacing varies, parameters as synonym",
     '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>\n  '
     '{"name": "b", "parameters": {"y": [1, 2]}}  \n</tool_call>\n', None, [("a", {"x": 1}), ("b", {"y": [1, 2]})]),
    ("hermes", "content before", f"Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", "content after", f"A <tool_call>{WEATHER}</tool_call> B", "A  B", [("get_weather", {"city": "Paris"})]),
    ("hermes", "malformed json", 'Sure <tool_call>{"name": "a", "arguments": {"x": }</tool_call>',
     'Sure <tool_call>{"name": "a", "arguments": {"x": }</tool_call>', []),
    ("hermes", "missing name", '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "text after the json inside the block",
     '<tool_call>{"name": "a", "arguments": {}} oops</tool_call>',
     '<tool_call>{"name": "a", "arguments": {}} oops</tool_call>', []),
    ("hermes", "malformed block then a good one", 'x<tool_call>{bad}</tool_call><tool_call>{"name": "a"}</tool_call>',
     "x<tool_call>{bad}</tool_call>", [("a", {})]),
    ("hermes", "unclosed last block", '<tool_call>{"name": "a", "arguments": {"q": "café"}}\n', None,
     [("a", {"q": "café"})]),
    ("hermes", "arguments as a json string", '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', None,
     [("a", {"x": 1})]),
    ("hermes", "no call", "  Paris is sunny < 30 degrees today.\n", "Paris is sunny < 30 degrees today.", []),
    ("llama3_json", "single", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", "python tag, arguments as synonym", f"<|python_tag|>{WEATHER}", None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", "parallel, separator inside a string",
     ' {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": "p;q"}}', None,
     [("a", {"x": 1}), ("b", {"y": "p;q"})]),
    ("llama3_json", "content after", '{"name": "a", "parameters": {}}\nDone.', "Done.", [("a", {})]),
    ("llama3_json", "text before is content", f"The call would be {WEATHER}", f"The call would be {WEATHER}", []),
    ("llama3_json", "malformed json", '{"name": "a", "parameters": {"x": 1}',
     '{"name": "a", "parameters": {"x": 1}', []),
    ("llama3_json", "no parameters", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", "no call", "Hello there.", "Hello there.", []),
    ("mistral", "array", f"[TOOL_CALLS][{WEATHER[:-1]}, \"id\": \"abc123def\"}}]", None,
     [("get_weather", {"city": "Paris"})]),
    ("mistral", "parallel array, content before",
     'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "Checking.",
     [("a", {"x": 1}), ("b", {})]),
    ("mistral", "v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", {"city": "Paris"})]),
    ("mistral", "v11 repeated, with a call id", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]k9Xz12345[ARGS]{}',
     None, [("a", {"x": 1}), ("b", {})]),
    ("mistral", "marker inside the arguments",
     '[TOOL_CALLS][{"name": "a", "arguments": {"x": "[TOOL_CALLS]b[ARGS]{}"}}]',
     None, [("a", {"x": "[TOOL_CALLS]b[ARGS]{}"})]),
    ("mistral", "malformed json", 'Hmm [TOOL_CALLS][{"name": "a", "arguments": {]',
     'Hmm [TOOL_CALLS][{"name": "a", "arguments": {]', []),
    ("mistral", "an entry without a name", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}]',
     '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}}]', []),
    ("mistral", "no call", "It is [sunny] in Paris.", "It is [sunny] in Paris.", []),
]
CASE_IDS = [f"{parser}: {case}" for parser, case, *_ in CASES]


def case_text(parser_name: str, case_name: str) -> str:
    return next(text for parser, case, text, *_ in CASES if (parser, case) == (parser_name, case_name))


def expected_calls(calls: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    return [(name, json.dumps(arguments, ensure_ascii=False)) for name, arguments in calls]


@pytest.mark.parametrize("parser_name, case, text, content, calls", CASES, ids=CASE_IDS)
def test_parse_reads_canned_generations(parser_name, case, text, content, calls):
    parsed = create_parser(parser_name).parse(text)
    assert parsed.content == content
    assert [(call.name, call.arguments) for call in parsed.tool_calls] == expected_calls(calls)


def test_ids_are_random_unless_the_model_gave_one():
    first, second = (create_parser("hermes").parse(f"<tool_call>{WEATHER}</tool_call>").tool_calls[0] for _ in range(2))
    assert RANDOM_CALL_ID.fullmatch(first.id) and RANDOM_CALL_ID.fullmatch(second.id)
    assert first.id != second.id
    mistral = create_parser("mistral")
    assert [call.id for call in mistral.parse(case_text("mistral", "array")).tool_calls] == ["abc123def"]
    assert mistral.parse(case_text("mistral", "v11 repeated, with a call id")).tool_calls[1].id == "k9Xz12345"


def test_arguments_keep_non_ascii_text():
    text = '<tool_call>{"name":"a","arguments":{"q":"caf\\u00e9"}}</tool_call>'
    (call,) = create_parser("hermes").parse(text).tool_calls
    assert call.arguments == '{"q": "café"}'
    function = {"name": "a", "arguments": call.arguments}
    assert call.as_openai() == {"id": call.id, "type": "function", "function": function}


@pytest.mark.parametrize("parser_name, text, safe_end", [
    ("hermes", "Hello", 5), ("hermes", "Hello <", 6), ("hermes", "Hello <tool_cal", 6), ("hermes", "a<tool_call>b", 1),
    ("hermes", "x < y", 5), ("hermes", "<tool_call", 0),
    ("mistral", "ok [TOOL", 3), ("mistral", "[TOOL_CALLS]f", 0), ("mistral", "[x]", 3),
    ("llama3_json", "", 0), ("llama3_json", " \n", 0), ("llama3_json", " {", 0), ("llama3_json", "<|python", 0),
    ("llama3_json", "<|python_tag|>{", 0), ("llama3_json", "Hi {", 4), ("llama3_json", "<|x", 3),
])
def test_content_safe_end_holds_back_what_may_begin_a_call(parser_name, text, safe_end):
    assert create_parser(parser_name).content_safe_end(text) == safe_end


# ---- streaming -------------------------------------------------------------------------------
def chunkings(text: str) -> list[list[str]]:
    """The whole text, char by char, and a few seeded random splits."""
    splits = [[text], list(text)]
    for seed in range(NUM_RANDOM_CHUNKINGS):
        rng = random.Random(seed)
        chunks, position = [], 0
        while position < len(text):
            size = rng.randint(1, MAX_RANDOM_CHUNK)
            chunks.append(text[position:position + size])
            position += size
        splits.append(chunks)
    return splits


def stream_deltas(parser: ToolCallParser, chunks: list[str]) -> list[StreamDelta]:
    stream = ToolCallStream(parser)
    return [stream.feed(chunk) for chunk in chunks] + [stream.finish()]


def assert_stream_matches_parse(parser: ToolCallParser, text: str) -> None:
    parsed = parser.parse(text)
    for chunks in chunkings(text):
        deltas = stream_deltas(parser, chunks)
        assert "".join(delta.content for delta in deltas) == (parsed.content or ""), chunks
        entries = [entry for delta in deltas for entry in delta.tool_calls]
        assert [entry["index"] for entry in entries] == list(range(len(parsed.tool_calls)))
        assert [entry["type"] for entry in entries] == ["function"] * len(entries)
        streamed = [(entry["function"]["name"], entry["function"]["arguments"]) for entry in entries]
        assert streamed == [(call.name, call.arguments) for call in parsed.tool_calls], chunks
        for entry, call in zip(entries, parsed.tool_calls):  # a model's id is kept, others are fresh
            assert entry["id"] == call.id if not RANDOM_CALL_ID.fullmatch(call.id) else RANDOM_CALL_ID.fullmatch(
                entry["id"])


@pytest.mark.parametrize("parser_name, case, text, content, calls", CASES, ids=CASE_IDS)
def test_stream_adds_up_to_the_whole_parse(parser_name, case, text, content, calls):
    assert_stream_matches_parse(create_parser(parser_name), text)


def test_stream_sends_content_and_complete_calls_before_the_end():
    stream = ToolCallStream(create_parser("hermes"))
    assert stream.feed("Let me check ").content == "Let me check"  # the space waits for more content
    assert stream.feed("the weather.\n<tool_").content == " the weather."
    delta = stream.feed(f"call>{WEATHER}</tool_call>")
    assert delta.content == ""
    assert [(entry["index"], entry["function"]["name"]) for entry in delta.tool_calls] == [(0, "get_weather")]
    assert stream.feed('\n<tool_call>{"name": "a", "arguments": {}}').is_empty  # unclosed: more text may follow
    last = stream.finish()
    assert last.content == ""
    assert [(entry["index"], entry["function"]["name"]) for entry in last.tool_calls] == [(1, "a")]


def test_stream_holds_text_after_a_marker_until_the_end():
    stream = ToolCallStream(create_parser("hermes"))
    assert stream.feed("A <tool_call>{bad}</tool_call> B").content == "A"
    assert stream.finish().content == " <tool_call>{bad}</tool_call> B"


@pytest.mark.parametrize("parser_name, text, first_call_at", [
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}', len('[TOOL_CALLS]a[ARGS]{"x": 1}')),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
     len('{"name": "a", "parameters": {}}')),
])
def test_stream_sends_each_call_when_its_json_closes(parser_name, text, first_call_at):
    stream = ToolCallStream(create_parser(parser_name))
    assert stream.feed(text[:first_call_at - 1]).is_empty
    closing = stream.feed(text[first_call_at - 1:first_call_at])
    assert [entry["function"]["name"] for entry in closing.tool_calls] == ["a"]
    assert [entry["function"]["name"] for entry in stream.feed(text[first_call_at:]).tool_calls] == ["b"]
    assert stream.finish().is_empty


def test_llama3_stream_sends_plain_content_at_once():
    stream = ToolCallStream(create_parser("llama3_json"))
    assert stream.feed(" ").content == ""
    assert stream.feed("Hel").content == "Hel"
    assert stream.feed("lo {").content == "lo {"


# ---- grammar-forced formats ------------------------------------------------------------------
def names(calls) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


def test_parse_required_reads_the_calls_completed_before_a_cut():
    calls = parse_required('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert names(calls) == [("a", '{"x": 1}'), ("b", "{}")]
    # cut off by max_tokens: the calls before the cut, never the raw array
    assert names(parse_required('[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu')) == [("a", '{"x": 1}')]
    assert names(parse_required('[{"name": "a", "arguments": {"x": 1}}')) == [("a", '{"x": 1}')]
    assert parse_required('[{"name": "a", "arguments": {"x": 1') == []
    assert names(parse_required('[{"name": "a", "arguments": {}}, {"arguments": {}}]')) == [("a", "{}")]
    assert parse_required('{"name": "a", "arguments": {}}') == []


def test_parse_required_before_the_end_holds_a_call_nothing_follows_yet():
    text = '[{"name": "a", "arguments": {}}'
    assert parse_required(text, final=False) == []
    assert names(parse_required(text + " ,", final=False)) == [("a", "{}")]
    assert names(RequiredCallsParser().parse(text + ", {", final=False).tool_calls) == [("a", "{}")]


def test_parse_named_reads_the_arguments_object():
    call = parse_named(' {"city": "Paris"} ', "get_weather")
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert RANDOM_CALL_ID.fullmatch(call.id)
    assert parse_named('{"city": "Par', "get_weather") is None
    assert parse_named("[1, 2]", "get_weather") is None


@pytest.mark.parametrize("parser, text, num_calls", [
    (RequiredCallsParser(), '[{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", "arguments": {}}]', 2),
    (RequiredCallsParser(), '[{"name": "a", "arguments": {"x": [1, 2', 0),
    (RequiredCallsParser(), '[{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "a", "arguments": {"x"', 1),
    (NamedCallParser("get_weather"), '{"city": "Paris"}', 1),
    (NamedCallParser("get_weather"), '{"city": "Pa', 0),
])
def test_forced_formats_stream_like_the_others(parser, text, num_calls):
    assert len(parser.parse(text).tool_calls) == num_calls
    assert parser.parse(text).content is None  # the grammar's JSON is never content
    assert_stream_matches_parse(parser, text)


# ---- choosing a parser from the chat template ------------------------------------------------
QWEN_LIKE = ("{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{ tool | tojson }}"
             "{%- endfor %}{{- '</tools>\\nCall functions in <tool_call></tool_call> tags.' }}{%- endif %}"
             "{%- for message in messages %}{{ message.content }}{%- endfor %}")
MISTRAL_LIKE = ("{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools and loop.last %}"
                "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ message.content }}[/INST]"
                "{%- elif message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}{%- endif %}{%- endfor %}")
LLAMA31_LIKE = ("{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- for t in tools %}{{ t | tojson }}"
                "{%- endfor %}{%- endif %}{%- for message in messages %}{%- if message.tool_calls %}"
                "{{- '<|python_tag|>' + message.tool_calls[0].function.name }}{%- endif %}{%- endfor %}")
LLAMA32_LIKE = ("{%- for message in messages %}{%- if message.role == 'ipython' %}{{ message.content | tojson }}"
                "{%- elif tools and loop.first %}{{ tools | tojson }}{%- endif %}{%- endfor %}")
PLAIN = "{%- for message in messages %}<|{{ message.role }}|>{{ message.content }}{%- endfor %}"
TOOLS_ONLY_IN_PROSE = "{# tools: not supported #}{{ 'You have no tools; say <tool_call> if asked.' }}" + PLAIN
UNKNOWN_TOOL_FORMAT = "{%- if tools %}<|tool_list|>{{ tools | tojson }}{%- endif %}" + PLAIN
UNPARSABLE_BY_JINJA = "{%- if tools %}<tool_call>{%- endif %}{% generation %}{{ messages }}{% endgeneration %}"


@pytest.mark.parametrize("template, parser_name", [
    (QWEN_LIKE, "hermes"), (MISTRAL_LIKE, "mistral"), (LLAMA31_LIKE, "llama3_json"), (LLAMA32_LIKE, "llama3_json"),
    (PLAIN, None), (TOOLS_ONLY_IN_PROSE, None), (UNKNOWN_TOOL_FORMAT, None), (UNPARSABLE_BY_JINJA, "hermes"),
    (None, None), ("", None),
], ids=["qwen", "mistral", "llama3.1", "llama3.2", "plain", "tools in prose", "unknown format", "jinja error",
        "none", "empty"])
def test_detect_parser_follows_the_template_markers(template, parser_name):
    assert detect_parser(template) == parser_name


def test_every_parser_name_creates_its_parser():
    assert PARSER_NAMES == ("hermes", "llama3_json", "mistral")
    assert [create_parser(name).name for name in PARSER_NAMES] == list(PARSER_NAMES)
    with pytest.raises(ValueError, match="hermes"):
        create_parser("pythonic")


# ---- prompts for templates without tools -----------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]


def test_tools_system_prompt_lists_each_function_as_json():
    prompt = tools_system_prompt(TOOLS)
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == [
        {"name": "get_weather", "description": "The weather in a city.",
         "parameters": TOOLS[0]["function"]["parameters"]},
        {"name": "now", "parameters": NO_PARAMETERS},
    ]
    # the example the prompt shows is a block the hermes parser reads as a call
    assert [call.name for call in create_parser("hermes").parse(prompt).tool_calls] == ["function_name"]


def test_rendered_tool_calls_parse_back():
    tool_calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"terms": [1, 2.5], "x": {}}'}},
        {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": ""}},
    ]
    parsed = create_parser("hermes").parse(render_tool_calls_as_text(tool_calls))
    assert parsed.content is None
    assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == [
        ("get_weather", {"city": "Zürich"}), ("add", {"terms": [1, 2.5], "x": {}}), ("now", {})]


def test_rendered_arguments_that_are_no_json_stay_content():
    text = render_tool_calls_as_text([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}])
    parsed = create_parser("hermes").parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
