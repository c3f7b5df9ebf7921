"""Waiting for a non-streaming response while watching the client: one that goes away aborts
its requests, which frees their KV blocks within one engine iteration."""
from __future__ import annotations

import asyncio

from starlette.requests import Request

from engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from engine.outputs import RequestOutput
from server.errors import APIError
from server.submission import Submission

DISCONNECT_POLL_S = 0.1
CLIENT_CLOSED_REQUEST = 499  # nginx's "client closed request": only the logs see it, the client is gone


async def collect_final_outputs(request: Request, submission: Submission) -> list[RequestOutput]:
    """The final output of every stream of `submission`, in order. If the client disconnects
    first, aborts them all (HTTP 499); an engine failure aborts them too (500, or 503 when the
    engine died)."""
    task = asyncio.ensure_future(asyncio.gather(*(_last_output(s) for s in submission.streams)))
    task.add_done_callback(_mark_exception_retrieved)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                submission.abort_unfinished()
                raise APIError(CLIENT_CLOSED_REQUEST, "client disconnected")
    except (RequestFailedError, EngineDeadError) as exc:
        submission.abort_unfinished()
        raise APIError(500 if isinstance(exc, RequestFailedError) else 503, str(exc),
                       type="internal_error") from None
    finally:
        if not task.done():
            task.cancel()


async def _last_output(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


def _mark_exception_retrieved(future: asyncio.Future) -> None:
    # a gather cancelled on disconnect ends with CancelledError that nobody awaits; asyncio would
    # log it as an error ("exception was never retrieved") for every client that went away
    if not future.cancelled():
        future.exception()
