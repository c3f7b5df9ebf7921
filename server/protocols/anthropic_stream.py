"""A chat stream's chunks as the Messages API streams a reply: message_start and a ping, then each
content block opened, filled and closed (text_delta for text, one input_json_delta per tool_use,
whose calls the chat stream sends whole), then message_delta with the stop reason and usage, and
message_stop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from server.errors import APIError
from server.protocols.anthropic import message_id, stop_of, usage
from server.sse import sse_event


def failure_event(exc: Exception) -> str:
    """The event that ends a stream the engine failed, in Anthropic's error shape."""
    return sse_event(APIError(500, str(exc), type="internal_error").anthropic_body(), "error")


@dataclass
class MessageStream:
    """One reply's events; `num_prompt_tokens` fills message_start's usage before the cache is known."""
    model: str
    num_prompt_tokens: int
    _num_blocks: int = 0
    _open_block: str | None = None  # the type of the block being filled
    _finish: dict = field(default_factory=dict)  # the finishing choice

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        chat_usage = None
        async for chunk in chunks:
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["delta"].get("role"):
                    yield self._message_start(chunk["id"])
                    yield {"type": "ping"}
                for event in self._deltas(choice):
                    yield event
        for event in self._close_block():
            yield event
        stop_reason, stop_sequence = stop_of(self._finish.get("finish_reason"), self._finish.get("stop_reason"))
        yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": usage(chat_usage)}
        yield {"type": "message_stop"}

    def _message_start(self, chat_id: str) -> dict:
        return {"type": "message_start", "message": {
            "id": message_id(chat_id), "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.num_prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}}

    def _deltas(self, choice: dict) -> list[dict]:
        delta, events = choice["delta"], []
        if delta.get("content"):
            if self._open_block != "text":
                events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            events += self._open({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            events += self._close_block()
        if choice["finish_reason"] is not None:
            self._finish = choice
        return events

    def _open(self, block: dict) -> list[dict]:
        events = self._close_block()
        self._open_block = block["type"]
        events.append({"type": "content_block_start", "index": self._num_blocks, "content_block": block})
        return events

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._num_blocks, "delta": delta}

    def _close_block(self) -> list[dict]:
        if self._open_block is None:
            return []
        self._open_block = None
        self._num_blocks += 1
        return [{"type": "content_block_stop", "index": self._num_blocks - 1}]
