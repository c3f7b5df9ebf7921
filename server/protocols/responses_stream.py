"""A chat stream's chunks as the Responses API streams a response: response.created and
response.in_progress, each output item added, filled and done (a message's output_text part with its
text deltas; a function_call's arguments, which the chat stream sends whole, as one delta), and
response.completed (response.incomplete when max_output_tokens cut it) with the whole response.
Every event carries its sequence_number."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from server.protocols.responses import (ResponsesRequest, function_call_item, message_item, output_text_part,
                                        response_body)
from server.sse import sse_event


@dataclass
class ResponseStream:
    request: ResponsesRequest
    _num_events: int = 0
    _output: list[dict] = field(default_factory=list)  # the items done
    _text: str | None = None  # the open message's text; None when no message is open
    _base_id: str = ""

    def failure_event(self, exc: Exception) -> str:
        """The event that ends a stream the engine failed."""
        return sse_event(self._event({"type": "error", "code": "internal_error", "message": str(exc), "param": None}),
                         "error")

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        chat, finish_reason = None, None
        async for chunk in chunks:
            chat = chunk
            for choice in chunk["choices"]:
                if choice["delta"].get("role"):
                    for event in self._start(chunk):
                        yield event
                for event in self._deltas(choice["delta"]):
                    yield event
                finish_reason = choice["finish_reason"] or finish_reason
        for event in self._close_message():
            yield event
        final = {**chat, "choices": [{"finish_reason": finish_reason}]}
        response = response_body(self.request, final, self._output)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield self._event({"type": kind, "response": response})

    def _start(self, chunk: dict) -> list[dict]:
        self._base_id = chunk["id"].partition("-")[2]
        response = response_body(self.request, {**chunk, "choices": [], "usage": None}, [])
        return [self._event({"type": "response.created", "response": response}),
                self._event({"type": "response.in_progress", "response": response})]

    def _deltas(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("content"):
            if self._text is None:
                events += self._open_message()
            self._text += delta["content"]
            events.append(self._event({"type": "response.output_text.delta", **self._text_place(),
                                       "delta": delta["content"], "logprobs": []}))
        for call in delta.get("tool_calls") or []:
            events += self._close_message()
            events += self._function_call(call)
        return events

    def _open_message(self) -> list[dict]:
        self._text = ""
        item = message_item(self._base_id, len(self._output), "", status="in_progress")
        return [self._event({"type": "response.output_item.added", "output_index": len(self._output), "item": item}),
                self._event({"type": "response.content_part.added", **self._text_place(),
                             "part": output_text_part("")})]

    def _close_message(self) -> list[dict]:
        if self._text is None:
            return []
        item = message_item(self._base_id, len(self._output), self._text)
        events = [self._event({"type": "response.output_text.done", **self._text_place(), "text": self._text,
                               "logprobs": []}),
                  self._event({"type": "response.content_part.done", **self._text_place(),
                               "part": output_text_part(self._text)}),
                  self._event({"type": "response.output_item.done", "output_index": len(self._output), "item": item})]
        self._output.append(item)
        self._text = None
        return events

    def _function_call(self, call: dict) -> list[dict]:
        output_index = len(self._output)
        added = function_call_item(self._base_id, output_index, call, status="in_progress")
        item = function_call_item(self._base_id, output_index, call)
        place = {"item_id": item["id"], "output_index": output_index}
        self._output.append(item)
        return [self._event({"type": "response.output_item.added", "output_index": output_index, "item": added}),
                self._event({"type": "response.function_call_arguments.delta", **place, "delta": item["arguments"]}),
                self._event({"type": "response.function_call_arguments.done", **place, "name": item["name"],
                             "arguments": item["arguments"]}),
                self._event({"type": "response.output_item.done", "output_index": output_index, "item": item})]

    def _text_place(self) -> dict:
        output_index = len(self._output)
        return {"item_id": f"msg_{self._base_id}_{output_index}", "output_index": output_index, "content_index": 0}

    def _event(self, event: dict) -> dict:
        event["sequence_number"] = self._num_events
        self._num_events += 1
        return event
