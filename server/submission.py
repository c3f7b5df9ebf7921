"""Handing one HTTP request's prompts to the AsyncEngine as engine requests, and taking them back."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from engine.engine import PreparedRequest
from engine.text import TokenizerError
from scheduler.sampling_params import ParamError, SamplingParams
from server.errors import APIError

# how long a client should wait before retrying when the engine loop has died
ENGINE_DEAD_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Submission:
    """The engine requests behind one HTTP request, one per prompt, in prompt order."""
    async_engine: AsyncEngine
    id: str  # the request ids' shared prefix; response ids are built from it
    request_ids: list[str]
    streams: list[RequestStream]
    prepared: list[PreparedRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.prompt_token_ids) for p in self.prepared)

    def abort_unfinished(self) -> None:
        """Abort every request whose stream has not finished, freeing its KV blocks."""
        for request_id, stream in zip(self.request_ids, self.streams):
            if not stream.finished:
                self.async_engine.abort(request_id)


async def submit(async_engine: AsyncEngine, prompts: list, params: SamplingParams) -> Submission:
    """Validate and tokenize every prompt (ParamError names the field), then queue them all or
    none: 429 with Retry-After when the waiting queue is full, 503 when the engine is dead.
    A structured output's grammar is compiled on a worker thread, off the event loop."""
    def prepare() -> list[PreparedRequest]:
        return [async_engine.prepare(prompt, params) for prompt in prompts]

    try:
        prepared = await asyncio.to_thread(prepare) if params.structured is not None else prepare()
    except TokenizerError as exc:
        raise ParamError("prompt", str(exc)) from None
    base_id = uuid.uuid4().hex
    request_ids, streams = [], []
    try:
        for index, prep in enumerate(prepared):
            request_ids.append(f"{base_id}-{index}")
            streams.append(async_engine.add_request(request_ids[-1], prep))
    except QueueFullError as exc:
        for request_id in request_ids[:-1]:  # the last one was refused, not queued
            async_engine.abort(request_id)
        raise APIError(429, f"the server is busy: {exc}; retry later", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": str(exc.retry_after_s)}) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="service_unavailable",
                       headers={"Retry-After": str(ENGINE_DEAD_RETRY_AFTER_S)}) from None
    return Submission(async_engine, base_id, request_ids, streams, prepared)
