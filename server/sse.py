"""Server-sent events as OpenAI streams them: `data: <json>` events, a `data: [DONE]` terminator,
an error event when the engine fails the request, and the outputs of several engine streams
merged into one. Anthropic's and the Responses API's streams name each event by its payload's
type and end without a terminator; their routes pass their own ending."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncGenerator, AsyncIterator, Callable, Sequence, TypeVar

from fastapi.responses import StreamingResponse

from engine.async_engine import EngineDeadError, RequestFailedError
from server.errors import APIError

DONE_EVENT = "data: [DONE]\n\n"
_END = object()  # a merged stream's last queue entry
T = TypeVar("T")


def sse_event(payload: dict, name: str | None = None) -> str:
    """One event carrying `payload` as JSON (non-ASCII text as is, as OpenAI sends it), named `name`."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_events(payloads: AsyncGenerator[dict, None], *, named: bool = False) -> AsyncGenerator[str, None]:
    """`payloads` as events; `named`: each named by its payload's "type"."""
    try:
        async for payload in payloads:
            yield sse_event(payload, payload["type"] if named else None)
    finally:
        await payloads.aclose()


def error_event(exc: Exception) -> str:
    """The event that ends a stream the engine failed: OpenAI's error shape, as a 500 would carry."""
    return sse_event(APIError(500, str(exc), type="internal_error").body())


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as they come, each tagged with its stream's index. An
    exception in any stream is raised to the consumer; closing the merge stops every stream."""
    if len(streams) == 1:  # no tasks or queue for the common case
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(index, stream, queue)) for index, stream in enumerate(streams)]
    num_open = len(streams)
    try:
        while num_open:
            index, item = await queue.get()
            if item is _END:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _pump(index: int, stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            await queue.put((index, item))
    except BaseException as exc:  # forwarded to the consumer
        await queue.put((index, exc))
    await queue.put((index, _END))


def event_stream_response(events: AsyncGenerator[str, None], on_close: Callable[[], None], *,
                          done: str = DONE_EVENT,
                          failure_event: Callable[[Exception], str] = error_event) -> StreamingResponse:
    """An SSE response of `events` then `done`, or `failure_event` if the engine fails the
    request. `on_close` runs however the stream ends, the client going away included: it aborts
    whatever is still unfinished."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
            if done:
                yield done
        except (RequestFailedError, EngineDeadError) as exc:
            yield failure_event(exc)
        finally:
            await events.aclose()
            on_close()

    return StreamingResponse(body(), media_type="text/event-stream")
