"""benchmarks/serving/protocols.py: each scenario's three bodies are valid requests of their protocol
and spell the same chat request; the table reads medians and ratios."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.serving.protocols import ENDPOINTS, SCENARIOS, markdown, request_body, summary
from server.protocol import ChatCompletionRequest, parse
from server.protocols import anthropic, responses


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=list(SCENARIOS))
def test_the_three_bodies_are_one_chat_request(scenario):
    question, stream, forced_tool = scenario
    chat = parse(ChatCompletionRequest, request_body("chat", question, 8, stream, forced_tool))
    via_messages = anthropic.chat_request(parse(anthropic.MessagesRequest,
                                                request_body("messages", question, 8, stream, forced_tool)))
    via_responses = responses.chat_request(parse(responses.ResponsesRequest,
                                                 request_body("responses", question, 8, stream, forced_tool)),
                                           chat.model)
    for translated in (via_messages, via_responses):
        assert translated.messages == chat.messages and translated.max_tokens == chat.max_tokens
        assert (translated.temperature, translated.stream) == (chat.temperature, chat.stream)
        assert translated.tools == chat.tools and translated.tool_choice == chat.tool_choice


def test_the_table_shows_medians_ranges_and_ratios():
    latencies = {"chat": [0.100, 0.110, 0.090], "messages": [0.105, 0.100, 0.120], "responses": [0.099, 0.1, 0.2]}
    row = summary(latencies, {endpoint: 32 for endpoint in ENDPOINTS})
    assert row["ratio"] == {"chat": 1.0, "messages": pytest.approx(1.05), "responses": pytest.approx(1.0)}
    table = markdown({"text": row}, argparse.Namespace(max_tokens=32, rounds=3))
    assert "| text | 100 (90-110) | 105 (100-120) | 1.050x | 100 (99-200) | 1.000x | 32, 32, 32 |" in table
