"""AsyncEngine: the engine loop on its own thread, async streams for the event loop.

Why a thread and not a process: the model's work is torch ops that release the GIL, so the
event loop stays responsive, and outputs reach the handlers without pickling. HTTP handlers
never call into the model; they hand requests and aborts to the loop thread through a
queue, which drains it before every iteration, so an abort frees its blocks within one
iteration.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from engine.runtime.runner import FatalRunnerError
from engine.engine import LLMEngine, RequestFailedError
from engine.request import PreparedRequest
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Too many requests or prompt tokens are waiting; try again later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QueueBounds:
    max_waiting_requests: int = 256
    max_waiting_tokens: int = 262144
    retry_after_s: int = 1


class RequestStream:
    """Outputs of one request as the engine produces them."""

    def __init__(self, request_id: str, num_sequences: int = 1) -> None:
        self.request_id = request_id
        self.num_sequences = num_sequences  # the request's n
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, bounds: QueueBounds = QueueBounds(),
                 on_iteration: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None,
                 on_abort: Callable[[LLMEngine, str, int], None] | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        """`on_dead(reason)`: called on the engine thread once the loop has died (not on shutdown)."""
        self.engine = engine
        self.bounds = bounds
        self._on_iteration = on_iteration
        self._on_abort = on_abort  # (engine, request_id, num_sequences) of each request aborted unfinished
        self._on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._pending_tokens: dict[str, int] = {}  # prompt tokens of requests not yet scheduled
        self._lock = threading.Lock()  # guards _streams and _pending_tokens
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self.dead_reason: str | None = None

    # ---- event-loop side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    def prepare(self, prompt: str | list[int], params) -> PreparedRequest:
        """Tokenize and validate (raises ParamError); pure, runs on the caller's thread."""
        return self.engine.prepare_request(prompt, params)

    def add_request(self, request_id: str, prepared: PreparedRequest) -> RequestStream:
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        num_tokens = len(prepared.prompt_token_ids)
        with self._lock:
            if len(self._pending_tokens) >= self.bounds.max_waiting_requests:
                raise QueueFullError(f"{len(self._pending_tokens)} requests are already waiting "
                                     f"(limit {self.bounds.max_waiting_requests})", self.bounds.retry_after_s)
            waiting_tokens = sum(self._pending_tokens.values())
            if self._pending_tokens and waiting_tokens + num_tokens > self.bounds.max_waiting_tokens:
                raise QueueFullError(f"{waiting_tokens} prompt tokens are already waiting "
                                     f"(limit {self.bounds.max_waiting_tokens})", self.bounds.retry_after_s)
            stream = RequestStream(request_id, prepared.params.n)
            self._streams[request_id] = (stream, asyncio.get_running_loop())
            self._pending_tokens[request_id] = num_tokens
        self._commands.put(("add", request_id, prepared))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the loop frees the request's blocks before its next step."""
        self._commands.put(("abort", request_id, None))
        self._wakeup.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and stop the loop thread."""
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                start = time.perf_counter()
                try:
                    outputs = self.engine.step()
                except FatalRunnerError:
                    raise  # no step can run any more: the loop dies and says why
                except Exception as exc:  # a bug must not take the server down: fail the batch, go on
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(RequestFailedError(f"internal error in the engine: {exc!r}"))
                    continue
                # metrics first: once a client has its output, /metrics already counts it
                if self._on_iteration is not None:
                    self._on_iteration(self.engine, outputs, time.perf_counter() - start)
                self._deliver(outputs)
                for failure in self.engine.take_failures():  # each alone: the others go on
                    self._finish_stream(failure.request_id, RequestFailedError(
                        f"internal error in the engine: {failure.reason}"))
        except BaseException as exc:  # the loop itself broke: report it and fail everyone
            logger.exception("engine loop died")
            self.dead_reason = f"the engine loop died: {exc}" if isinstance(exc, FatalRunnerError) \
                else f"the engine loop died: {exc!r}"
        finally:
            if self.dead_reason is None and not self._stop.is_set():
                self.dead_reason = "the engine loop stopped"
            self._fail_all(EngineDeadError(self.dead_reason or "the server is shutting down"))
            if self.dead_reason is not None and self._on_dead is not None:
                self._on_dead(self.dead_reason)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, request_id, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    live = request_id in self._streams
                if not live:
                    continue  # aborted before it reached the engine
                try:
                    self.engine.add_request(payload, request_id=request_id)
                except Exception as exc:
                    self._finish_stream(request_id, exc)
            else:
                self.engine.abort_request(request_id)
                with self._lock:
                    entry = self._streams.pop(request_id, None)
                    self._pending_tokens.pop(request_id, None)
                # decided here, on the engine thread: a request that finished or failed before its
                # abort arrived has no stream left and is not counted as aborted
                if entry is not None and self._on_abort is not None:
                    self._on_abort(self.engine, request_id, entry[0].num_sequences)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            for output in outputs:
                self._pending_tokens.pop(output.request_id, None)
                entry = self._streams.get(output.request_id)
                if entry is None:
                    continue
                stream, loop = entry
                if output.finished:
                    del self._streams[output.request_id]
                _call_soon(loop, stream.put, output)

    def _finish_stream(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            entry = self._streams.pop(request_id, None)
            self._pending_tokens.pop(request_id, None)
        if entry is not None:
            _call_soon(entry[1], entry[0].put, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self.engine.abort_request(request_id)
            self._finish_stream(request_id, exc)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the event loop already closed (shutdown): nobody is listening
        pass
