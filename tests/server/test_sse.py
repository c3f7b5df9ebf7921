"""SSE framing, the stream merger and the streaming response, without a model: fake async
streams fed by the test, and the response driven as an ASGI app."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.async_engine import EngineDeadError, RequestFailedError
from server.sse import DONE_EVENT, error_event, event_stream_response, merge_streams, sse_event

TIMEOUT_S = 5.0


class FedStream:
    """An async stream that yields what the test puts in, ends on `close`, raises on `fail`."""

    _CLOSE = object()

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed_by_consumer = False

    def put(self, item) -> None:
        self.queue.put_nowait(item)

    def close(self) -> None:
        self.queue.put_nowait(self._CLOSE)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    async def items(self):
        try:
            while (item := await self.queue.get()) is not self._CLOSE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        except asyncio.CancelledError:
            self.closed_by_consumer = True
            raise


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


# ---- framing ------------------------------------------------------------------------------
def test_event_framing():
    assert sse_event({"text": "héllo 🙂", "n": [1, None]}) == 'data: {"text": "héllo 🙂", "n": [1, null]}\n\n'
    assert DONE_EVENT == "data: [DONE]\n\n"


def test_error_event_has_openai_error_shape():
    event = error_event(RequestFailedError("internal error in the engine: boom"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):]) == {"error": {
        "message": "internal error in the engine: boom", "type": "internal_error", "param": None, "code": None}}


# ---- merging ------------------------------------------------------------------------------
def test_merge_interleaves_in_arrival_order_and_tags_each_item():
    async def scenario():
        first, second = FedStream(), FedStream()
        merged = merge_streams([first.items(), second.items()])
        received = []
        for stream, item in [(first, "a1"), (second, "b1"), (second, "b2"), (first, "a2")]:
            stream.put(item)
            received.append(await anext(merged))
        first.close()
        second.put("b3")
        received.append(await anext(merged))
        second.close()
        with pytest.raises(StopAsyncIteration):
            await anext(merged)
        return received

    assert run(scenario()) == [(0, "a1"), (1, "b1"), (1, "b2"), (0, "a2"), (1, "b3")]


def test_merge_forwards_an_exception_and_stops_the_other_streams():
    async def scenario():
        first, second = FedStream(), FedStream()
        merged = merge_streams([first.items(), second.items()])
        second.put("b1")
        assert await anext(merged) == (1, "b1")
        second.fail(RequestFailedError("boom"))
        with pytest.raises(RequestFailedError, match="boom"):
            await anext(merged)
        await asyncio.sleep(0)  # let the cancelled pumps run to their end
        return first.closed_by_consumer

    assert run(scenario())


def test_closing_the_merge_stops_every_stream():
    async def scenario():
        streams = [FedStream() for _ in range(3)]
        merged = merge_streams([s.items() for s in streams])
        streams[2].put("c1")
        assert await anext(merged) == (2, "c1")
        await merged.aclose()
        await asyncio.sleep(0)
        return [s.closed_by_consumer for s in streams]

    assert run(scenario()) == [True, True, True]


def test_merge_of_one_stream_passes_items_and_errors_through():
    async def scenario():
        only = FedStream()
        merged = merge_streams([only.items()])
        only.put("x")
        assert await anext(merged) == (0, "x")
        only.fail(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await anext(merged)

    run(scenario())


# ---- the streaming response ---------------------------------------------------------------
async def serve(response, disconnect_after_first_chunk: bool = False) -> str:
    """Run `response` as an ASGI app; the client goes away after the first event if asked."""
    chunks: list[bytes] = []
    first_chunk = asyncio.Event()

    async def send(message) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            chunks.append(message["body"])
            first_chunk.set()

    async def receive() -> dict:
        if disconnect_after_first_chunk:
            await first_chunk.wait()
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # a client that stays

    await response({"type": "http", "method": "POST", "path": "/"}, receive, send)
    return b"".join(chunks).decode()


def test_events_then_done_then_on_close():
    closes = []

    async def events():
        yield sse_event({"i": 0})
        yield sse_event({"i": 1})

    response = event_stream_response(events(), lambda: closes.append(True))
    assert response.media_type == "text/event-stream"
    assert run(serve(response)) == 'data: {"i": 0}\n\ndata: {"i": 1}\n\n' + DONE_EVENT
    assert closes == [True]


@pytest.mark.parametrize("failure", [RequestFailedError("boom"), EngineDeadError("the engine loop died")])
def test_engine_failure_ends_with_an_error_event_and_no_done(failure):
    closes = []

    async def events():
        yield sse_event({"i": 0})
        raise failure

    body = run(serve(event_stream_response(events(), lambda: closes.append(True))))
    assert body == 'data: {"i": 0}\n\n' + error_event(failure)
    assert closes == [True]


def test_client_going_away_runs_on_close_without_done():
    closes = []
    events_closed = []

    async def events():
        try:
            yield sse_event({"i": 0})
            await asyncio.Event().wait()  # the engine has nothing more yet
            yield sse_event({"i": 1})
        finally:
            events_closed.append(True)

    body = run(serve(event_stream_response(events(), lambda: closes.append(True)),
                     disconnect_after_first_chunk=True))
    assert body == 'data: {"i": 0}\n\n'
    assert closes == [True] and events_closed == [True]
