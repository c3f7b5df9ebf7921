"""The multi-turn benchmark's conversations (benchmarks/serving/conversation.py): texts, each turn's
history, and running them against a mock transport (no server)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.load.client import Endpoint
from benchmarks.serving.conversation import (Conversation, ConversationShape, build_conversations, run_conversations,
                                       user_message_lengths)
from benchmarks.load.prompts import PromptBuilder

CHAT = Endpoint("http://fake", "m", "chat")
SHAPE = ConversationShape(num_conversations=4, num_turns=3, num_system_tokens=40, min_user_tokens=6,
                          max_user_tokens=10, num_output_tokens=5)


class WordCounter:
    """A tokenizer where a word is a token."""

    def count(self, text: str) -> int:
        return len(text.split())


def conversation(num_turns: int = 3) -> Conversation:
    return Conversation(0, "sys", tuple(f"u{t}" for t in range(num_turns)), 10, (4,) * num_turns)


def test_each_turn_sends_the_system_prompt_the_history_and_the_next_message():
    c = conversation()
    assert c.messages([]) == [{"role": "system", "content": "sys"}, {"role": "user", "content": "u0"}]
    assert c.messages(["a0", "a1"]) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}]
    with pytest.raises(ValueError, match="3 turns"):
        c.messages(["a0", "a1", "a2"])


def test_target_input_tokens_grow_by_a_message_and_a_reply_per_turn():
    c = conversation()
    assert [c.num_target_input_tokens(t, num_output_tokens=5) for t in range(3)] == [14, 23, 32]


def test_conversations_share_the_system_prompt_and_are_reproducible():
    conversations = build_conversations(PromptBuilder(WordCounter(), seed=1), SHAPE, seed=1)
    assert len(conversations) == 4 and all(c.num_turns == 3 for c in conversations)
    assert len({c.system_prompt for c in conversations}) == 1
    assert len(conversations[0].system_prompt.split()) == 40
    users = [u for c in conversations for u in c.user_messages]
    assert len(set(users)) == len(users)  # no user message repeats another's prefix by accident
    for c in conversations:
        assert [len(u.split()) for u in c.user_messages] == list(c.num_user_tokens)
        assert all(6 <= n <= 10 for n in c.num_user_tokens)
    assert build_conversations(PromptBuilder(WordCounter(), seed=1), SHAPE, seed=1) == conversations
    assert build_conversations(PromptBuilder(WordCounter(), seed=2), SHAPE, seed=2) != conversations


def test_user_message_lengths_cover_the_range():
    shape = ConversationShape(64, 6, 400, 60, 100, 64)
    lengths = user_message_lengths(shape, seed=0)
    assert lengths.shape == (64, 6) and lengths.min() >= 60 and lengths.max() <= 100
    assert lengths.min() < 65 and lengths.max() > 95


def test_shape_is_checked_and_bounds_the_context():
    assert SHAPE.num_max_context_tokens == 40 + 3 * (10 + 5)
    with pytest.raises(ValueError, match="positive"):
        ConversationShape(0, 6, 400, 60, 100, 64)
    with pytest.raises(ValueError, match="range"):
        ConversationShape(16, 6, 400, 100, 60, 64)


def chat_stream(reply_words: list[str]) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]} for word in reply_words]
    events.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(reply_words)}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def run(conversations, handler, **kwargs):
    options = {"request_timeout_s": 10.0, "max_duration_s": 30.0, "progress": False}
    return asyncio.run(run_conversations(CHAT, conversations, 2, transport=httpx.MockTransport(handler),
                                         **{**options, **kwargs}))


def test_replies_from_the_server_join_the_next_turns_history():
    sent = []

    def handler(request):
        body = json.loads(request.content)
        sent.append(body["messages"])
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return httpx.Response(200, content=chat_stream([f" r{turn}", "!"]))

    conversations = [conversation(), Conversation(1, "sys", ("v0", "v1", "v2"), 10, (4, 4, 4))]
    records = run(conversations, handler)
    assert [len(turns) for turns in records] == [3, 3]
    assert all(r.ok and r.num_output_tokens == 2 for turns in records for r in turns)
    assert [r.output_text for r in records[0]] == [" r0!", " r1!", " r2!"]
    last = [m for m in sent if m[1]["content"] == "u0" and len(m) == 6][0]
    assert last == conversations[0].messages([" r0!", " r1!"])
    assert {r.index for turns in records for r in turns} == set(range(6))
    assert [r.num_target_input_tokens for r in records[0]] == [14, 20, 26]
    first_turn_end = records[0][0].end_s  # a conversation's turns never overlap
    assert records[0][1].start_s >= first_turn_end


def test_a_failed_turn_ends_its_conversation_only():
    def handler(request):
        messages = json.loads(request.content)["messages"]
        if messages[1]["content"] == "u0" and len(messages) == 4:  # conversation 0's second turn
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, content=chat_stream([" ok"]))

    failing, fine = run([conversation(), Conversation(1, "sys", ("v0", "v1", "v2"), 10, (4, 4, 4))], handler)
    assert failing[0].ok and failing[1].error == "500" and failing[2].start_s is None
    assert all(r.ok for r in fine)


def test_think_time_separates_turns():
    records = run([conversation(2)], lambda request: httpx.Response(200, content=chat_stream([" x"])),
                  think_time_s=0.05)
    assert records[0][1].start_s - records[0][0].end_s >= 0.05
