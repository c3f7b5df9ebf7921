"""The CPU side of a sliced MLP: where the parts the CPU computes (ScheInfer's CC) run, and
with how many threads. On the testbed the GPU thread hands such work to the engine
thread, which runs it while it waits; on CUDA and inline the engine thread runs it after
launching the GPU's parts (engine/device/queues.py, `run_on_host`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from engine.device.queues import GpuQueue, InlineQueue
from engine.quant import LinearWeight
from engine.quant.base import WrappedWeight
from engine.quant.int4 import CpuInt4Kernels
from scheduler.planning.tiers import Tier

HOST = torch.device("cpu")


class CpuSide:
    """How a sliced MLP reaches the CPU: the GPU queue the forward runs on (inline until
    the runner hands its own), and the threads CC's kernels use (None: the caller's)."""

    def __init__(self, num_threads: int | None) -> None:
        self.queue: GpuQueue = InlineQueue()
        self.num_threads = num_threads

    def own_threads(self, weight: LinearWeight) -> LinearWeight:
        """`weight` (a CC part) with its INT4 kernels on the CPU side's threads; dense ones
        follow the calling thread's torch threads (`threads`)."""
        for part in weight.parts:
            kernels = getattr(part, "kernels", None)
            if self.num_threads is not None and isinstance(kernels, CpuInt4Kernels):
                kernels.num_threads = self.num_threads  # each weight has kernels of its own
        return weight

    @contextmanager
    def threads(self):
        """The CPU side's torch thread count (per thread under OpenMP), the caller's after."""
        before = torch.get_num_threads()
        if self.num_threads is not None and self.num_threads != before:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


class HostWeight(WrappedWeight):
    """A CC weight: computed by the CPU where it is stored, reported in host memory."""

    tier = Tier.HOST

    def __init__(self, weight: LinearWeight) -> None:
        super().__init__(weight)
        self.method = weight.method

    def with_tensors(self, tensors):
        return HostWeight(self.inner.with_tensors(tensors))
