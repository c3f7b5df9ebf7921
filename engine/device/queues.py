"""In-order GPU work queues: the small stream/event abstraction Neo's pipeline runs on.

The engine thread is the pipeline's conductor and the CPU attention worker at once: it `submit`s
GPU work (linear stages, GPU attention, copies) in order and, while that runs,
computes decoding attention of CPU-requests itself, waiting on a `Future` only when it needs a
result. Three implementations:

- `InlineQueue`: work runs at once on the caller. A CPU-only host without the testbed: nothing
  overlaps, but the pipelined forward computes exactly what it computes elsewhere (the tests'
  reference for identical tokens).
- `WorkerThreadQueue`, the host-only testbed: the "GPU" is a dedicated thread pinned to
  its own cores with its own torch thread count, executing queued work in order, while the CPU
  attention runs on the remaining cores. The overlap is real and measurable on a 2-core box.
- `CudaStreamQueue`: work is launched at once on the compute stream (launches are asynchronous);
  copies between the pools go on a side stream ordered by events; `Future.result()` waits on an
  event. Untested on real hardware in CI (no GPU there).

GPU work may hand work back to the CPU side (ScheInfer's CPU-computed MLP slice,
engine/offload/slicing/sliced_mlp.py): `run_on_host` runs it on the engine thread, the one that
conducts the forward, and `copy_to_host` starts the activations' hop there. On the testbed the
GPU thread queues it and the engine thread runs it while it waits on a future; on CUDA and
inline the engine thread itself runs the GPU's work (launches), so the host work runs when
its result is first asked for, after the GPU's share was launched.
"""
from __future__ import annotations

import collections
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


class DeferredFuture(Future):
    """Work that runs on the thread that first asks for its result, once."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(self._run_once)
        self._fn: Callable[[], Any] | None = fn

    def _run_once(self) -> None:
        fn, self._fn = self._fn, None
        if fn is None:
            return
        try:
            self._value = fn()
        except BaseException as exc:  # raised by result(), now and on every later call
            self._error = exc


class GpuQueue(ABC):
    """Runs submitted callables on the GPU, in submission order."""

    device: torch.device

    @abstractmethod
    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn`; its return value (tensors may still be in flight on CUDA) is the future's."""

    def submit_copy(self, fn: Callable[[], Any]) -> Future:
        """Queue pool-to-pool copies (swaps). Ordered before every later `submit`."""
        return self.submit(fn)

    def run_on_host(self, fn: Callable[[], Any]) -> Future:
        """`fn` on the CPU side (the engine thread), for GPU work that hands part of its
        work to the CPU; the GPU's work waits on the future where it needs the value. Here:
        run when the result is first asked for (the caller conducts the GPU, so by then it
        has launched what overlaps)."""
        return DeferredFuture(fn)

    def copy_to_host(self, tensor: torch.Tensor) -> Future:
        """Start copying a GPU tensor to host memory (ordered after the work that makes
        it); the future's value is the host copy. Here the GPU's memory is the host's."""
        future = Future()
        future._value = tensor
        return future

    def synchronize(self) -> None:
        self.submit(lambda: None).result()

    def recover(self) -> None:
        """After a failed forward: wait until nothing is in flight and accept work again."""

    def close(self) -> None:
        """Release threads; the queue accepts no more work."""


def _RECOVER() -> None:
    """Marker item: clears a worker queue's error."""


class InlineQueue(GpuQueue):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def submit(self, fn):
        future = Future()
        future._value = fn()  # errors propagate to the caller right away
        return future


class WorkerThreadQueue(GpuQueue):
    """The host-only testbed's GPU: one thread, its own cores, its own torch threads.

    Work the GPU thread hands to the host (`run_on_host`) is queued for the engine thread,
    which runs it while it waits on any of this queue's futures: the engine thread is the CPU side
    (its cores, its thread count), and a forward's engine thread always comes back to wait."""

    def __init__(self, cores: set[int] | None, num_threads: int, name: str = "tandem-gpu") -> None:
        if num_threads < 1:
            raise ValueError(f"the GPU thread needs >= 1 torch thread, got {num_threads}")
        self.device = torch.device("cpu")
        self.cores = cores
        self.num_threads = num_threads
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        # The first error of a forward: later items depend on the failed one, so they are skipped
        # and fail with it instead of computing on half-written tensors. Cleared by `recover`.
        self._error: BaseException | None = None
        # host work from the GPU thread, and what wakes a waiter: that work or an item done
        self._host_work: collections.deque = collections.deque()
        self._wakeup = threading.Condition()
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
            with self._wakeup:
                done.set()
                self._wakeup.notify_all()

    def submit(self, fn):
        if not self._thread.is_alive():
            raise RuntimeError("the GPU thread has stopped")
        done = threading.Event()
        future = Future(lambda: self._wait_serving_host(done))
        self._items.put((fn, future, done))
        return future

    def run_on_host(self, fn):
        if threading.current_thread() is not self._thread:
            return super().run_on_host(fn)  # called from the CPU side already
        done = threading.Event()
        future = Future(done.wait)
        with self._wakeup:
            self._host_work.append((fn, future, done))
            self._wakeup.notify_all()
        return future

    def _wait_serving_host(self, done: threading.Event) -> None:
        """Wait for an item, running the host work the GPU thread queues meanwhile."""
        if threading.current_thread() is self._thread:  # only ever on work already done
            done.wait()
            return
        while True:
            with self._wakeup:
                while not done.is_set() and not self._host_work:
                    self._wakeup.wait()
                if not self._host_work:
                    return
                fn, future, host_done = self._host_work.popleft()
            try:
                with torch.inference_mode():
                    future._value = fn()
            except BaseException as exc:  # the GPU's work that waits on it fails with it
                future._error = exc
            host_done.set()

    def recover(self) -> None:
        self.submit(_RECOVER).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._items.put(None)
            self._thread.join()


class CudaStreamQueue(GpuQueue):
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

    def copy_to_host(self, tensor):
        # on the copy stream, after the compute that makes `tensor`, into pinned memory
        self.copies.wait_stream(self.compute)
        with torch.cuda.stream(self.copies):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copies)
        tensor.record_stream(self.copies)  # not reused by the compute stream before the copy is done
        future = Future(event.synchronize)
        future._value = host
        return future
