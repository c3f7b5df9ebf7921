"""Thread-level parallelism of the host's tasks (LM-Offload sec. 4.2, Algorithm 3), adapted to
tandem: how many of the host's cores play the GPU on the testbed, and how many threads the CPU
side (Neo's decoding attention and ScheInfer's CC parts), the copy engine and the O_DIRECT
readers take. Plain Python, no torch: the engine measures the task profiles
(engine/profiling/thread_probe.py) and turns them into one iteration's work
(engine/planning/threads.py).

Algorithm 3 enumerates the compute task's threads, gives the load/store tasks threads in
proportion to their bytes, predicts each split from offline profiles and keeps the best. Here:
- testbed: the GPU thread takes g = 1..num_cores-1 cores and the CPU side c <= num_cores - g
  threads on the rest. The GPU's linear work runs beside the CPU side's attention and CC parts,
  so an iteration takes the slower of the two; the copy engine's memcpy runs on the CPU side's
  cores, so its time adds to that side's; O_DIRECT reads overlap both.
- cuda: the CPU side takes every core; the GPU's own time is not the host's to split, and its
  copies are a DMA engine's.
- cpu: one serial forward on torch's pool of every core: nothing to split.
Copies and reads share the CPU side's cores (every core off the testbed) in proportion to their
bytes per forward, at least one thread each where they move bytes. Today's split is evaluated
first and kept on a tie.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

TESTBED, CUDA, CPU = "testbed", "cuda", "cpu"
DEVICE_KINDS = (TESTBED, CUDA, CPU)
THREAD_TASKS = ("gpu", "cpu", "copy", "io")  # the `task` label of tandem:threads

DEFAULT_IO_THREADS = 4  # --weight-io-threads' default: O_DIRECT reads in flight
# Predictions this close (relative) are a tie: floating-point sums of the same times differ by less.
TIE_TOLERANCE = 1e-9


# ---- what was measured ------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskProfile:
    """One host task's seconds for its unit of work at the thread counts it was measured at, e.g.
    {1: 0.012, 2: 0.007}. Counts not measured are estimated from their neighbours, and never
    come out faster than the best measured."""

    seconds_by_threads: Mapping[int, float]

    def __post_init__(self) -> None:
        if not self.seconds_by_threads:
            raise ValueError("a task profile needs at least one measured thread count")
        for num_threads, seconds in self.seconds_by_threads.items():
            if not isinstance(num_threads, int) or num_threads < 1:
                raise ValueError(f"a thread count must be an int >= 1, got {num_threads!r}")
            if not seconds >= 0.0 or seconds == float("inf"):
                raise ValueError(f"seconds at {num_threads} threads must be finite and >= 0, got {seconds!r}")
        object.__setattr__(self, "seconds_by_threads", dict(sorted(self.seconds_by_threads.items())))

    @property
    def thread_counts(self) -> tuple[int, ...]:
        return tuple(self.seconds_by_threads)

    def seconds(self, num_threads: int) -> float:
        """Measured where it was; between two measured counts, on the line between them; below
        the fewest, the fewest's time with the work split over fewer threads (x fewest / n);
        beyond the most, flat (more threads than were measured are not taken to help)."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        table, counts = self.seconds_by_threads, self.thread_counts
        if num_threads in table:
            return table[num_threads]
        if num_threads > counts[-1]:
            return table[counts[-1]]
        if num_threads < counts[0]:
            return table[counts[0]] * counts[0] / num_threads
        above = bisect.bisect(counts, num_threads)
        low, high = counts[above - 1], counts[above]
        weight = (num_threads - low) / (high - low)
        return table[low] + weight * (table[high] - table[low])

    def scaled(self, factor: float) -> "TaskProfile":
        """The same task over `factor` units of work (the time taken as proportional to it)."""
        if not factor >= 0.0:
            raise ValueError(f"factor must be >= 0, got {factor!r}")
        return TaskProfile({n: s * factor for n, s in self.seconds_by_threads.items()})

    def plus(self, other: "TaskProfile") -> "TaskProfile":
        """Both tasks back to back on the same threads, at every count either was measured at."""
        counts = sorted(set(self.thread_counts) | set(other.thread_counts))
        return TaskProfile({n: self.seconds(n) + other.seconds(n) for n in counts})

    def to_dict(self) -> dict[str, float]:
        return {str(n): s for n, s in self.seconds_by_threads.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TaskProfile":
        return cls({int(n): float(s) for n, s in data.items()})


@dataclass(frozen=True)
class IterationProfiles:
    """Each host task's seconds for one iteration's share of it, by thread count; None where the
    task does not run or its time is not known (it then adds nothing to a prediction)."""

    gpu: TaskProfile | None = None  # testbed: the GPU thread's linear work (device cpu: the forward's)
    cpu: TaskProfile | None = None  # the CPU side: decoding attention and CC parts
    copy: TaskProfile | None = None  # the host copy engine's memcpy of the forward's streamed bytes
    io: TaskProfile | None = None  # O_DIRECT reads of the forward's disk-tier bytes


# ---- what is chosen ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ThreadSplit:
    """How many threads each host task takes."""

    gpu_threads: int  # testbed: cores that play the GPU; 0 elsewhere
    cpu_threads: int  # the CPU side: decoding attention and CC parts (device cpu: the serial forward's)
    copy_threads: int  # the host copy engine's threads; 0 where a DMA engine copies (cuda)
    io_threads: int  # O_DIRECT reads in flight; 0 where nothing is read from disk

    def __post_init__(self) -> None:
        for name in ("gpu_threads", "copy_threads", "io_threads"):
            _require_count(name, getattr(self, name), 0)
        _require_count("cpu_threads", self.cpu_threads, 1)

    def by_task(self) -> dict[str, int]:
        """Thread counts under THREAD_TASKS' names."""
        return dict(zip(THREAD_TASKS, (self.gpu_threads, self.cpu_threads, self.copy_threads, self.io_threads)))

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{task} {count}" for task, count in self.by_task().items()) + " threads"


@dataclass(frozen=True)
class FixedThreads:
    """Counts the user gave (flags); None: planned."""

    gpu_threads: int | None = None
    cpu_threads: int | None = None
    copy_threads: int | None = None
    io_threads: int | None = None

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if value is not None:
                _require_count(item.name, value, 1)


def _require_count(name: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


@dataclass(frozen=True)
class Candidate:
    split: ThreadSplit
    predicted_s: float  # one iteration, as the profiles predict it

    def to_dict(self) -> dict[str, Any]:
        return {**self.split.to_dict(), "predicted_s": self.predicted_s}


@dataclass(frozen=True)
class ThreadPlan:
    """The chosen split with its predicted iteration time, today's split (`default`), and every
    candidate evaluated, today's first."""

    chosen: Candidate
    default: Candidate
    candidates: tuple[Candidate, ...] = field(repr=False)

    @property
    def split(self) -> ThreadSplit:
        return self.chosen.split

    @property
    def predicted_s(self) -> float:
        return self.chosen.predicted_s

    def describe(self) -> str:
        if self.predicted_s == 0.0:  # no task's time known: nothing was measured to choose by
            return f"{self.split.describe()} (today's split: nothing measured to plan from)"
        text = f"{self.split.describe()} (an iteration predicted {self.predicted_s * 1e3:.2f} ms"
        if self.chosen.split == self.default.split:
            return text + f"; today's split, best of {len(self.candidates)} evaluated)"
        return text + f"; today's {self.default.split.describe()}: {self.default.predicted_s * 1e3:.2f} ms)"

    def to_dict(self) -> dict[str, Any]:
        """The chosen and today's split with their predictions (the candidates, thousands on a
        big host, only counted)."""
        return {"chosen": self.chosen.to_dict(), "default": self.default.to_dict(),
                "num_candidates": len(self.candidates)}


# ---- the planner --------------------------------------------------------------------------------
def plan_threads(num_cores: int, device_kind: str, profiles: IterationProfiles, *, copy_bytes: int = 0,
                 io_bytes: int = 0, fixed: FixedThreads = FixedThreads()) -> ThreadPlan:
    """Algorithm 3 on `num_cores` host cores: every compute split the device allows, with the
    transfer threads given by bytes per forward (`copy_bytes` host -> GPU, `io_bytes` read from
    disk), predicted from `profiles`; the fastest, on a tie the one with fewest disk readers beyond
    their cores, then today's. Counts in `fixed` are kept. ValueError for a device kind, core count or fixed count that cannot be served."""
    _check(num_cores, device_kind, fixed)
    volumes = (copy_bytes, io_bytes)

    def evaluated(split: ThreadSplit) -> Candidate:
        return Candidate(split, predict_seconds(split, num_cores, device_kind, profiles))

    default = evaluated(default_split(num_cores, device_kind, volumes, fixed))
    chosen, candidates = default, [default]
    for split in compute_splits(num_cores, device_kind, volumes, fixed):
        if split == default.split:
            continue
        candidate = evaluated(split)
        candidates.append(candidate)
        if _better(candidate, chosen, num_cores, device_kind):
            chosen = candidate
    return ThreadPlan(chosen, default, tuple(candidates))


def _better(candidate: Candidate, chosen: Candidate, num_cores: int, device_kind: str) -> bool:
    """Faster beyond the tie tolerance; on a tie, fewer disk readers beyond their cores (the
    profiles time no reads: 4 readers beside the CPU side's one core ran 1.15x slower than 1 on the
    2-core VM, benchmarks/offload/thread_split.py)."""
    if candidate.predicted_s < chosen.predicted_s * (1.0 - TIE_TOLERANCE):
        return True
    tie = candidate.predicted_s <= chosen.predicted_s * (1.0 + TIE_TOLERANCE)
    return tie and (oversubscribed_threads(candidate.split, num_cores, device_kind)
                    < oversubscribed_threads(chosen.split, num_cores, device_kind))


def oversubscribed_threads(split: ThreadSplit, num_cores: int, device_kind: str) -> int:
    """Disk reader threads beyond the cores they share with the CPU side (the cores the GPU leaves
    on the testbed, every core elsewhere)."""
    return max(0, split.io_threads - (num_cores - split.gpu_threads))


def _check(num_cores: int, device_kind: str, fixed: FixedThreads) -> None:
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device kind must be one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}")
    _require_count("num_cores", num_cores, 2 if device_kind == TESTBED else 1)
    if device_kind == TESTBED and fixed.gpu_threads is not None and fixed.gpu_threads >= num_cores:
        raise ValueError(f"gpu_threads ({fixed.gpu_threads}) leaves no core for the CPU side "
                         f"({num_cores} cores)")


def default_split(num_cores: int, device_kind: str, volumes: tuple[int, int], fixed: FixedThreads) -> ThreadSplit:
    """Today's rules (engine/device/cores.py CoreAssignment.for_device), fixed counts kept:
    the testbed's GPU takes half the cores and the CPU side and its copy engine the rest; off the
    testbed the CPU side takes every core and the copy engine one thread (none on cuda); the
    disk reader DEFAULT_IO_THREADS where it reads."""
    _, io_bytes = volumes
    io_threads = fixed.io_threads or (DEFAULT_IO_THREADS if io_bytes else 0)
    if device_kind == TESTBED:
        gpu_threads = fixed.gpu_threads or max(1, num_cores // 2)
        rest = num_cores - gpu_threads
        return ThreadSplit(gpu_threads, fixed.cpu_threads or rest, fixed.copy_threads or rest, io_threads)
    copy_threads = fixed.copy_threads or (0 if device_kind == CUDA else 1)
    return ThreadSplit(0, fixed.cpu_threads or num_cores, copy_threads, io_threads)


def compute_splits(num_cores: int, device_kind: str, volumes: tuple[int, int],
                   fixed: FixedThreads) -> Iterator[ThreadSplit]:
    """The splits Algorithm 3 evaluates: on the testbed every GPU share with every CPU-side
    thread count its remaining cores hold (more first); on cuda every core to the CPU side with
    the reader planned; on device cpu none besides today's."""
    if device_kind == TESTBED:
        gpu_counts = [fixed.gpu_threads] if fixed.gpu_threads else range(1, num_cores)
        for gpu_threads in gpu_counts:
            rest = num_cores - gpu_threads
            copy_threads, io_threads = planned_transfers(rest, volumes, fixed, idle_copy_threads=rest)
            for cpu_threads in [fixed.cpu_threads] if fixed.cpu_threads else range(rest, 0, -1):
                yield ThreadSplit(gpu_threads, cpu_threads, copy_threads, io_threads)
    elif device_kind == CUDA:  # the copies are a DMA engine's: the reader alone shares the cores
        _, io_bytes = volumes
        copy_threads, io_threads = planned_transfers(num_cores, (0, io_bytes), fixed, idle_copy_threads=0)
        yield ThreadSplit(0, fixed.cpu_threads or num_cores, copy_threads, io_threads)


def planned_transfers(num_threads: int, volumes: tuple[int, int], fixed: FixedThreads,
                      idle_copy_threads: int) -> tuple[int, int]:
    """(copy, io) threads: `transfer_threads`' shares, fixed counts kept; a copy engine that
    streams nothing per forward keeps `idle_copy_threads` (it still copies resident layers in at
    load)."""
    copy_threads, io_threads = transfer_threads(num_threads, *volumes)
    return fixed.copy_threads or copy_threads or idle_copy_threads, fixed.io_threads or io_threads


def transfer_threads(num_threads: int, copy_bytes: int, io_bytes: int) -> tuple[int, int]:
    """Algorithm 3's rule for load/store tasks: `num_threads` shared by the copy engine and the
    disk reader in proportion to their bytes per forward, at least one each where it moves bytes,
    none where it moves nothing (a rounded-up share goes to the copies)."""
    total_bytes = copy_bytes + io_bytes
    if total_bytes <= 0:
        return 0, 0
    if not io_bytes:
        return num_threads, 0
    if not copy_bytes:
        return 0, num_threads
    copy_threads = max(1, round(num_threads * copy_bytes / total_bytes))
    return copy_threads, max(1, num_threads - copy_threads)


def predict_seconds(split: ThreadSplit, num_cores: int, device_kind: str, profiles: IterationProfiles) -> float:
    """One iteration under `split` with the concurrency the forward allows (the module's
    docstring); a task given more threads than its cores runs at its cores' count."""
    io_s = _seconds(profiles.io, split.io_threads)
    if device_kind == TESTBED:
        cpu_cores = num_cores - split.gpu_threads
        gpu_s = _seconds(profiles.gpu, split.gpu_threads)
        cpu_s = (_seconds(profiles.cpu, min(split.cpu_threads, cpu_cores))
                 + _seconds(profiles.copy, min(split.copy_threads, cpu_cores)))
        return max(gpu_s, cpu_s, io_s)
    cpu_threads = min(split.cpu_threads, num_cores)
    if device_kind == CUDA:
        return max(_seconds(profiles.cpu, cpu_threads), io_s)
    serial_s = (_seconds(profiles.gpu, cpu_threads) + _seconds(profiles.cpu, cpu_threads)
                + _seconds(profiles.copy, min(split.copy_threads, num_cores)))
    return max(serial_s, io_s)


def _seconds(profile: TaskProfile | None, num_threads: int) -> float:
    """A task's time; 0 where it does not run (no profile, or no threads)."""
    return profile.seconds(num_threads) if profile is not None and num_threads > 0 else 0.0
