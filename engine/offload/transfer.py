"""Copy engines: how bytes get from host memory into the GPU's layer buffers, and how
loads and computes are ordered around a buffer (PIPO sec. 3.3, host -> GPU).

- `HostCopyEngine` (device cpu and the host-only testbed): the GPU's buffers are host
  tensors of their own, and a copy is a real memcpy, split into chunks over a few threads (pinned
  off the GPU's cores on the testbed, as a GPU's copy engine takes none of its SMs).
  Copies finish before `copy` returns, so the ordering hooks have nothing to do.
- `CudaCopyEngine`: pinned host buffers, a copy stream, events. A load waits (on the copy stream)
  for the event its buffer's last compute recorded when released; the compute stream waits for
  the event the load recorded; a disk staging buffer is reused only once its copies are done.
  Not yet run on a GPU (docs/architecture.md, "Not built yet").
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from engine.registry import Registry
from engine.weights.direct_io import aligned_empty

# Below this a copy is not split over threads: the hand-off would cost more than it saves.
MIN_CHUNK_BYTES = 4 * 2**20


def pin_to(cores: frozenset[int] | None) -> Callable[[], None]:
    """A thread initializer keeping a transfer thread to `cores` with one torch thread (its copies
    must not spread over the GPU's cores)."""
    def initialize() -> None:
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(1)
    return initialize


class CopyEngine(ABC):
    """Moves layer bytes host -> GPU and orders loads against computes per buffer. A
    buffer's per-engine state (events on CUDA) lives in the dict `state` the caller keeps for it."""

    device: torch.device
    cores: frozenset[int] | None = None  # host cores the transfer threads keep to (testbed)
    copies_on_host_cores = False  # copies are host threads' work (memcpy), not a DMA engine's

    @abstractmethod
    def allocate_buffer(self, nbytes: int) -> torch.Tensor:
        """A GPU-side layer buffer: uint8 [nbytes], allocated once, before serving."""

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A host buffer copies leave from (a host-tier layer, a disk staging buffer): aligned for
        O_DIRECT reads, pinned where the engine copies asynchronously."""
        return aligned_empty(nbytes)

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[:] = src (uint8, same length): host -> GPU, queued or done."""

    def before_load(self, state: dict[str, Any]) -> None:
        """Before the first copy into a buffer: what used it has finished with it."""

    def after_load(self, state: dict[str, Any]) -> None:
        """After the last copy into a buffer."""

    def load(self, dst: torch.Tensor, src: torch.Tensor, state: dict[str, Any]) -> None:
        """A buffer's whole load in one copy: after what used it, before what reads it."""
        self.before_load(state)
        self.copy(dst, src)
        self.after_load(state)

    def wait_loaded(self, state: dict[str, Any]) -> None:
        """On the compute side, before a layer's weights are read: its copies are done."""

    def on_release(self, state: dict[str, Any]) -> None:
        """On the compute side, when a layer's buffer is given back: its computes are queued."""

    def wait_source_free(self, state: dict[str, Any]) -> None:
        """Before a host staging buffer is overwritten: the copies leaving it are done."""

    def synchronize(self) -> None:
        """Every copy queued so far is done."""

    def close(self) -> None:
        """Release threads."""


COPY_ENGINES: Registry[CopyEngine] = Registry("copy engine")  # by torch device type


def create_copy_engine(device: torch.device | str, num_threads: int = 1,
                       cores: frozenset[int] | None = None) -> CopyEngine:
    device = torch.device(device)
    return COPY_ENGINES.create(device.type, device, num_threads, cores)


@COPY_ENGINES.register("cpu")
class HostCopyEngine(CopyEngine):
    """GPU buffers are host tensors apart from the host tier's; copies are memcpy."""

    copies_on_host_cores = True

    def __init__(self, device: torch.device, num_threads: int = 1, cores: frozenset[int] | None = None) -> None:
        self.device = device
        self.num_threads = num_threads
        self.cores = cores
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tandem-copy", initializer=pin_to(cores))

    def allocate_buffer(self, nbytes: int) -> torch.Tensor:
        # zeroed: touched now, so no page fault lands on the hot path
        return aligned_empty(nbytes).zero_()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = dst.numel()
        num_chunks = max(1, min(self.num_threads, nbytes // MIN_CHUNK_BYTES))
        bounds = [nbytes * i // num_chunks for i in range(num_chunks + 1)]
        # the calling thread copies too, with its own torch thread count (the transfer threads' 1)
        futures = [self._pool.submit(_copy_range, dst, src, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        _copy_range(dst, src, bounds[0], bounds[1])
        for future in futures:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _copy_range(dst: torch.Tensor, src: torch.Tensor, start: int, end: int) -> None:
    dst[start:end].copy_(src[start:end])


@COPY_ENGINES.register("cuda")
class CudaCopyEngine(CopyEngine):
    """A copy stream beside the compute stream; events order them per buffer."""

    def __init__(self, device: torch.device, num_threads: int = 1, cores: frozenset[int] | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def allocate_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def before_load(self, state):
        released = state.get("released")
        if released is not None:
            self.stream.wait_event(released)

    def after_load(self, state):
        state["loaded"] = event = torch.cuda.Event()
        event.record(self.stream)

    def wait_loaded(self, state):
        torch.cuda.current_stream(self.device).wait_event(state["loaded"])

    def on_release(self, state):
        state["released"] = event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))

    def wait_source_free(self, state):
        copied = state.get("loaded")
        if copied is not None:
            copied.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()
