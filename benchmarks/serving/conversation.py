"""Multi-turn chat conversations for a serving benchmark: what each turn sends, and running them.

A conversation is a system prompt (the same for every conversation, as a chat frontend or an
agent has) and a fixed list of user messages. Turn t sends the system prompt, every earlier user
message followed by the assistant's reply to it, and user message t. Replies are the server's own
output, so the history grows as it would in a real chat and a server's prefix cache sees what it
would see there. Conversations run concurrently, each one's turns in order: a turn is sent once
the previous reply is complete (after an optional think time). Texts come from
benchmarks/load/prompts.py's seeded word streams, so every system and repetition gets the same ones.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import numpy as np

from benchmarks.load.client import ChatMessages, Endpoint, RequestRecord
from benchmarks.load.prompts import PromptBuilder
from benchmarks.load.runner import open_client, progress_bar, send_within

SYSTEM_PROMPT_INDEX = 0  # the prompt builder's index of the shared system prompt; user messages follow it
_USER_LENGTHS_STREAM = 4  # seed-stream tag, distinct from workload.py's and prompts.py's


@dataclass(frozen=True)
class ConversationShape:
    """How many conversations, how long each part is (tokens)."""
    num_conversations: int
    num_turns: int
    num_system_tokens: int
    min_user_tokens: int
    max_user_tokens: int
    num_output_tokens: int

    def __post_init__(self) -> None:
        if min(self.num_conversations, self.num_turns, self.num_system_tokens, self.min_user_tokens,
               self.num_output_tokens) < 1:
            raise ValueError(f"every count of a conversation must be positive: {self}")
        if self.max_user_tokens < self.min_user_tokens:
            raise ValueError(f"user message lengths {self.min_user_tokens}-{self.max_user_tokens} are not a range")

    @property
    def num_max_context_tokens(self) -> int:
        """The last turn's prompt plus its reply at the longest user messages, template tokens aside."""
        return self.num_system_tokens + self.num_turns * (self.max_user_tokens + self.num_output_tokens)


@dataclass(frozen=True)
class Conversation:
    index: int
    system_prompt: str
    user_messages: tuple[str, ...]
    num_system_tokens: int
    num_user_tokens: tuple[int, ...]  # each user message's target length

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def messages(self, replies: list[str]) -> ChatMessages:
        """What turn len(replies) sends: the system prompt, each earlier exchange, the next user message."""
        turn = len(replies)
        if turn >= self.num_turns:
            raise ValueError(f"conversation {self.index} has {self.num_turns} turns, not {turn + 1}")
        messages = [{"role": "system", "content": self.system_prompt}]
        for user, reply in zip(self.user_messages, replies):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": self.user_messages[turn]})
        return messages

    def num_target_input_tokens(self, turn: int, num_output_tokens: int) -> int:
        """Turn `turn`'s prompt length when every reply is `num_output_tokens` long (no template tokens)."""
        return self.num_system_tokens + sum(self.num_user_tokens[:turn + 1]) + turn * num_output_tokens


def user_message_lengths(shape: ConversationShape, seed: int) -> np.ndarray:
    """[num_conversations, num_turns] token counts, uniform in the shape's range."""
    rng = np.random.default_rng([seed, _USER_LENGTHS_STREAM])
    return rng.integers(shape.min_user_tokens, shape.max_user_tokens, endpoint=True,
                        size=(shape.num_conversations, shape.num_turns))


def user_message_index(conversation: int, turn: int, num_turns: int) -> int:
    """The prompt builder's index of a user message: past the system prompt's, one per (conversation, turn)."""
    return SYSTEM_PROMPT_INDEX + 1 + conversation * num_turns + turn


def build_conversations(builder: PromptBuilder, shape: ConversationShape, seed: int) -> list[Conversation]:
    """The conversations of `shape`, texts drawn by `builder` (exact lengths when it has a counter)."""
    system = builder.build(SYSTEM_PROMPT_INDEX, shape.num_system_tokens)
    lengths = user_message_lengths(shape, seed)
    conversations = []
    for c in range(shape.num_conversations):
        users = [builder.build(user_message_index(c, t, shape.num_turns), int(n)) for t, n in enumerate(lengths[c])]
        conversations.append(Conversation(c, system.text, tuple(u.text for u in users), shape.num_system_tokens,
                                          tuple(int(n) for n in lengths[c])))
    return conversations


async def run_conversations(endpoint: Endpoint, conversations: list[Conversation], num_output_tokens: int, *,
                            request_timeout_s: float, max_duration_s: float, think_time_s: float = 0.0,
                            description: str = "", progress: bool = True,
                            transport: httpx.AsyncBaseTransport | None = None) -> list[list[RequestRecord]]:
    """Every conversation at once, each one's turns in order; per conversation, one record per turn.

    A conversation stops at its first failed turn (later turns would lack a reply in their history),
    and no turn is sent after `max_duration_s`: the records of turns not sent keep no start time.
    `transport` replaces the network (tests pass an httpx.MockTransport).
    """
    records = [[RequestRecord(c.index * c.num_turns + t, c.num_target_input_tokens(t, num_output_tokens),
                              num_output_tokens) for t in range(c.num_turns)] for c in conversations]
    bar = progress_bar(sum(map(len, records)), description, progress)

    async with open_client(endpoint, request_timeout_s, transport) as client:
        clock_zero = time.perf_counter()

        async def converse(conversation: Conversation, turns: list[RequestRecord]) -> None:
            replies: list[str] = []
            for turn, record in enumerate(turns):
                if turn and think_time_s:
                    await asyncio.sleep(think_time_s)
                if time.perf_counter() - clock_zero > max_duration_s:
                    return
                await send_within(client, endpoint, conversation.messages(replies), record, clock_zero,
                                  request_timeout_s)
                bar.update()
                if not record.ok:
                    return
                replies.append(record.output_text)

        await asyncio.gather(*(converse(c, r) for c, r in zip(conversations, records)))
    bar.close()
    return records
