"""In-order accelerator work queues: the small stream/event abstraction Neo's pipeline runs on.

The engine thread is the pipeline's conductor and the CPU attention worker at once: it `submit`s
accelerator work (linear stages, accelerator attention, copies) in order and, while that runs,
computes decoding attention of CPU-requests itself, waiting on a `Future` only when it needs a
result. Three implementations:

- `InlineQueue`: work runs at once on the caller. A CPU-only host without the testbed: nothing
  overlaps, but the pipelined forward computes exactly what it computes elsewhere (the tests'
  reference for identical tokens).
- `WorkerThreadQueue`, the host-only testbed: the "accelerator" is a dedicated thread pinned to
  its own cores with its own torch thread count, executing queued work in order, while the CPU
  attention runs on the remaining cores. The overlap is real and measurable on a 2-core box.
- `CudaStreamQueue`: work is launched at once on the compute stream (launches are asynchronous);
  copies between the pools go on a side stream ordered by events; `Future.result()` waits on an
  event. Untested on real hardware in CI (no GPU there).
"""
from __future__ import annotations

import os
import queue
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch


class Future:
    """The value of one submitted piece of work; `result()` blocks until it is ready."""

    def __init__(self, wait: Callable[[], None] | None = None) -> None:
        self._wait = wait
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self) -> Any:
        if self._wait is not None:
            self._wait()
        if self._error is not None:
            raise self._error
        return self._value


class AcceleratorQueue(ABC):
    """Runs submitted callables on the accelerator, in submission order."""

    device: torch.device

    @abstractmethod
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn`; its return value (tensors may still be in flight on CUDA) is the future's."""

    def submit_copy(self, fn: Callable[[], Any]) -> Future:
        """Queue pool-to-pool copies (swaps). Ordered before every later `submit`."""
        return self.submit(fn)

    def synchronize(self) -> None:
        self.submit(lambda: None).result()

    def recover(self) -> None:
        """After a failed forward: wait until nothing is in flight and accept work again."""

    def close(self) -> None:
        """Release threads; the queue accepts no more work."""


def _RECOVER() -> None:
    """Marker item: clears a worker queue's error."""


class InlineQueue(AcceleratorQueue):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def submit(self, fn):
        future = Future()
        future._value = fn()  # errors propagate to the caller right away
        return future


class WorkerThreadQueue(AcceleratorQueue):
    """The host-only testbed's accelerator: one thread, its own cores, its own torch threads."""

    def __init__(self, cores: set[int] | None, num_threads: int, name: str = "tandem-accelerator") -> None:
        if num_threads < 1:
            raise ValueError(f"the accelerator thread needs >= 1 torch thread, got {num_threads}")
        self.device = torch.device("cpu")
        self.cores = cores
        self.num_threads = num_threads
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # The first error of a forward: later items depend on the failed one, so they are skipped
        # and fail with it instead of computing on half-written tensors. Cleared by `recover`.
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        if self.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cores)  # 0 = this thread (Linux)
        torch.set_num_threads(self.num_threads)  # per-thread under OpenMP: the engine thread keeps its own
        self._started.set()
        while True:
            item = self._items.get()
            if item is None:
                return
            fn, future, done = item
            if fn is _RECOVER:
                self._error = None
            elif self._error is not None:
                future._error = self._error
            else:
                try:
                    with torch.inference_mode():
                        future._value = fn()
                except BaseException as exc:  # handed to whoever waits on this or a later future
                    self._error = future._error = exc
            done.set()

    def submit(self, fn):
        if not self._thread.is_alive():
            raise RuntimeError("the accelerator thread has stopped")
        done = threading.Event()
        future = Future(done.wait)
        self._items.put((fn, future, done))
        return future

    def recover(self) -> None:
        self.submit(_RECOVER).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._items.put(None)
            self._thread.join()


class CudaStreamQueue(AcceleratorQueue):
    """Launch at once on the compute stream; copies on a side stream; events order the two."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self.compute = torch.cuda.current_stream(self.device)
        self.copies = torch.cuda.Stream(self.device)

    def _launch(self, fn, stream, other) -> Future:
        stream.wait_stream(other)  # keep one total order between the two streams
        with torch.cuda.stream(stream):
            value = fn()
            event = torch.cuda.Event()
            event.record(stream)
        future = Future(event.synchronize)
        future._value = value
        return future

    def submit(self, fn):
        return self._launch(fn, self.compute, self.copies)

    def submit_copy(self, fn):
        return self._launch(fn, self.copies, self.compute)
