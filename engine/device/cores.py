"""Core pinning: which host cores play the GPU on the testbed and which run the CPU
attention, and how many threads each gets (by today's fixed rules, or a planned `ThreadSplit`)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch

from scheduler.planning.threads import ThreadSplit


def host_cores() -> list[int]:
    """The cores this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def device_kind(device: str) -> str:
    """testbed, cpu or cuda: what plays the GPU."""
    return "testbed" if device == "testbed" else torch.device(device).type


@dataclass(frozen=True)
class CoreAssignment:
    """Which cores do what on the host-only testbed (and how many threads the CPU attention and
    the host copy engine use anywhere). `cpu` and `cuda`: the GPU needs no cores of its own.
    (Where weights live is a different question: engine/weights.)"""

    device: str
    gpu_cores: frozenset[int] = frozenset()
    cpu_attention_cores: frozenset[int] = frozenset()
    cpu_attention_threads: int = 1
    # the host copy engine's threads, kept to cpu_attention_cores where there are some (a CUDA
    # copy engine takes none: its copies are the DMA engine's)
    copy_threads: int = 1

    @classmethod
    def for_device(cls, device: str, gpu_threads: int | None = None, cpu_attention_threads: int | None = None,
                   cores: list[int] | None = None) -> "CoreAssignment":
        """Today's fixed rules over `cores` (default: this process's): the testbed's GPU takes half
        the cores (or `gpu_threads`), the CPU side and the copy engine the rest; on cuda the CPU side
        takes them all."""
        kind, cores = device_kind(device), cores or host_cores()
        if kind == "cuda":  # the host's cores are all the CPU attention's while the GPU computes
            return cls(kind, cpu_attention_cores=frozenset(cores),
                       cpu_attention_threads=cpu_attention_threads or len(cores), copy_threads=len(cores))
        if kind != "testbed":
            # serial on one CPU: torch's pool owns the cores between ops (CpuPagedDecode.IN_ENGINE_THREADS)
            return cls(kind, cpu_attention_threads=cpu_attention_threads or 1)
        # Default split: half the cores play the GPU, the rest run the CPU attention.
        num_gpu = gpu_threads or max(1, len(cores) // 2)
        rest = len(cores) - num_gpu
        return cls._on_testbed(cores, num_gpu, cpu_attention_threads or rest, rest)

    @classmethod
    def from_split(cls, device: str, split: ThreadSplit, cpu_attention_threads: int | None = None) -> "CoreAssignment":
        """The cores of a planned split (scheduler/planning/threads.py). `cpu_attention_threads`: on
        device cpu only, the attention kernel's threads inside the serial forward (None: 1), since
        there the split's CPU side is torch's pool for the whole forward."""
        kind, cores = device_kind(device), host_cores()
        copy_threads = split.copy_threads or 1  # a copy engine that copies nothing per forward still loads
        if kind == "cuda":
            return cls(kind, cpu_attention_cores=frozenset(cores), cpu_attention_threads=split.cpu_threads,
                       copy_threads=copy_threads)
        if kind != "testbed":
            return cls(kind, cpu_attention_threads=cpu_attention_threads or 1, copy_threads=copy_threads)
        return cls._on_testbed(cores, split.gpu_threads, split.cpu_threads, copy_threads)

    @classmethod
    def _on_testbed(cls, cores: list[int], num_gpu: int, cpu_attention_threads: int,
                    copy_threads: int) -> "CoreAssignment":
        """The first `num_gpu` cores play the GPU, the rest are the CPU side's."""
        if len(cores) < 2:
            raise ValueError("the host-only testbed needs at least 2 cores: one for the GPU thread, "
                             "one for the CPU attention")
        if not 1 <= num_gpu < len(cores):
            raise ValueError(f"gpu_threads ({num_gpu}) leaves no core for the CPU attention "
                             f"({len(cores)} cores)")
        return cls("testbed", frozenset(cores[:num_gpu]), frozenset(cores[num_gpu:]), cpu_attention_threads,
                   copy_threads)

    @classmethod
    def for_rank(cls, device: str, rank_cores: Sequence[int]) -> "CoreAssignment":
        """A tensor-parallel rank's assignment over its own run of cores (none: every core its
        process may use): the testbed on one core where it has one, else today's rules."""
        if device_kind(device) == "testbed" and len(rank_cores) == 1:
            return cls.testbed_on_one_core(rank_cores[0])
        return cls.for_device(device, cores=list(rank_cores) or None)

    @classmethod
    def testbed_on_one_core(cls, core: int) -> "CoreAssignment":
        """The testbed on a single core (a tensor-parallel rank's share of a small host): the GPU
        thread and the CPU side take turns on it, so nothing overlaps, but every path runs."""
        return cls("testbed", frozenset({core}), frozenset({core}), 1, 1)

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


def rank_core_sets(cores: list[int], world_size: int) -> list[tuple[int, ...]]:
    """The host's cores cut into `world_size` disjoint runs (each rank's CPU attention on its own),
    empty where there are fewer cores than ranks."""
    if len(cores) < world_size:
        return [()] * world_size
    per_rank = len(cores) // world_size
    return [tuple(cores[rank * per_rank:(rank + 1) * per_rank]) for rank in range(world_size)]
