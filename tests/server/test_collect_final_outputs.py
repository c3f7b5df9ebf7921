"""Collecting a non-streaming response's final outputs while watching for the client to go away,
with real RequestStreams fed by the test and a real Starlette Request over a fake receive."""
from __future__ import annotations

import asyncio
import gc
import logging

import pytest
from starlette.requests import Request

from engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.disconnect import DISCONNECT_POLL_S, collect_final_outputs
from server.errors import APIError
from server.submission import Submission

TIMEOUT_S = 5.0


class AbortRecorder:
    """Stands in for the AsyncEngine, whose abort is all a Submission calls."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def output(request_id: str, text: str, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, [1], finish_reason="length" if finished else None)
    return RequestOutput(request_id, "prompt", [1], [completion], finished, RequestMetrics(arrival_time=0.0))


def http_request(disconnected: asyncio.Event) -> Request:
    """A request whose client is gone once `disconnected` is set."""
    async def receive() -> dict:
        if disconnected.is_set():
            return {"type": "http.disconnect"}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def submission(num_streams: int) -> Submission:
    request_ids = [f"base-{i}" for i in range(num_streams)]
    return Submission(AbortRecorder(), "base", request_ids, [RequestStream(r) for r in request_ids], [])


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_final_outputs_come_in_stream_order():
    async def scenario():
        sub = submission(2)
        task = asyncio.ensure_future(collect_final_outputs(http_request(asyncio.Event()), sub))
        sub.streams[1].put(output("base-1", "b", finished=True))
        sub.streams[0].put(output("base-0", "a", finished=False))
        await asyncio.sleep(DISCONNECT_POLL_S * 1.5)  # a poll finds the client still there
        sub.streams[0].put(output("base-0", "a a", finished=True))
        return await task, sub.async_engine.aborted

    finals, aborted = run(scenario())
    assert [(f.request_id, f.outputs[0].text) for f in finals] == [("base-0", "a a"), ("base-1", "b")]
    assert aborted == []


def test_client_going_away_aborts_the_unfinished_with_499():
    async def scenario():
        sub = submission(3)
        disconnected = asyncio.Event()
        task = asyncio.ensure_future(collect_final_outputs(http_request(disconnected), sub))
        sub.streams[1].put(output("base-1", "done", finished=True))
        await asyncio.sleep(0)
        disconnected.set()
        with pytest.raises(APIError) as info:
            await task
        return info.value, sub.async_engine.aborted

    error, aborted = run(scenario())
    assert (error.status, error.message) == (499, "client disconnected")
    assert aborted == ["base-0", "base-2"]


def test_a_disconnect_leaves_no_unretrieved_exception_to_log(caplog):
    async def scenario():
        sub = submission(1)
        disconnected = asyncio.Event()
        disconnected.set()
        with pytest.raises(APIError):
            await collect_final_outputs(http_request(disconnected), sub)
        await asyncio.sleep(0)  # let the cancelled gather finish

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        run(scenario())
        gc.collect()  # asyncio reports an unretrieved exception when the future is collected
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


@pytest.mark.parametrize("failure,status", [(RequestFailedError("internal error in the engine: boom"), 500),
                                            (EngineDeadError("the engine loop died"), 503)])
def test_engine_failure_aborts_the_rest(failure, status):
    async def scenario():
        sub = submission(2)
        task = asyncio.ensure_future(collect_final_outputs(http_request(asyncio.Event()), sub))
        sub.streams[0].put(failure)
        with pytest.raises(APIError) as info:
            await task
        return info.value, sub.async_engine.aborted

    error, aborted = run(scenario())
    assert (error.status, error.message, error.type) == (status, str(failure), "internal_error")
    assert aborted == ["base-1"]  # the failed stream is finished already
