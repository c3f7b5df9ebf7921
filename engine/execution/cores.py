"""Core pinning: which host cores play the GPU on the testbed and which run the CPU
attention, and how many threads each gets."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CoreAssignment:
    """Which cores do what on the host-only testbed (and how many threads the CPU attention uses
    anywhere). `cpu` and `cuda`: the GPU needs no cores of its own. (Where weights live
    is a different question: engine/weights.)"""

    device: str
    gpu_cores: frozenset[int] = frozenset()
    cpu_attention_cores: frozenset[int] = frozenset()
    cpu_attention_threads: int = 1

    @classmethod
    def for_device(cls, device: str, gpu_threads: int | None = None,
                   cpu_attention_threads: int | None = None) -> "CoreAssignment":
        kind = torch.device(device).type if device != "testbed" else "testbed"
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if kind == "cuda":  # the host's cores are all the CPU attention's while the GPU computes
            return cls(kind, cpu_attention_cores=frozenset(cores), cpu_attention_threads=cpu_attention_threads or len(cores))
        if kind != "testbed":
            # serial on one CPU: torch's pool owns the cores between ops (CpuPagedDecode.IN_ENGINE_THREADS)
            return cls(kind, cpu_attention_threads=cpu_attention_threads or 1)
        if len(cores) < 2:
            raise ValueError("the host-only testbed needs at least 2 cores: one for the GPU thread, "
                             "one for the CPU attention")
        # Default split: half the cores play the GPU, the rest run the CPU attention.
        num_gpu = gpu_threads or max(1, len(cores) // 2)
        if num_gpu >= len(cores):
            raise ValueError(f"gpu_threads ({num_gpu}) leaves no core for the CPU attention "
                             f"({len(cores)} cores)")
        rest = cores[num_gpu:]
        return cls("testbed", frozenset(cores[:num_gpu]), frozenset(rest),
                   cpu_attention_threads or len(rest))

    @property
    def gpu_threads(self) -> int:
        return len(self.gpu_cores) or 1

    @contextmanager
    def on_cpu_cores(self):
        """Testbed: the thread that conducts the pipeline computes the CPU attention, so for the
        forward it keeps to the CPU's cores and thread count and leaves the GPU's alone;
        the caller's own settings come back afterwards."""
        if self.device != "testbed" or not hasattr(os, "sched_setaffinity"):
            yield
            return
        cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, set(self.cpu_attention_cores))
        torch.set_num_threads(self.cpu_attention_threads)
        try:
            yield
        finally:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
