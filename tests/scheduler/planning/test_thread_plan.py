"""Algorithm 3's thread planner (scheduler/planning/threads.py), without torch: on fresh random
profiles its choice is the best of an exhaustive search over every compute split under the same
iteration model, written out again here; fixed counts are kept, ties go to today's split, and
cuda and cpu have nothing (or only the reader) to plan."""
import dataclasses
import random

import pytest

from scheduler.planning.threads import (
    CPU,
    CUDA,
    DEFAULT_IO_THREADS,
    TESTBED,
    FixedThreads,
    IterationProfiles,
    TaskProfile,
    ThreadSplit,
    default_split,
    oversubscribed_threads,
    plan_threads,
    transfer_threads,
)

NUM_TRIALS = 200


def random_profile(rng: random.Random, max_threads: int) -> TaskProfile:
    """Seconds at a random subset of counts, noisy and not always faster with more threads."""
    counts = sorted(rng.sample(range(1, max_threads + 1), rng.randint(1, max_threads)))
    base = rng.uniform(1e-4, 1e-1)
    return TaskProfile({n: base / n ** rng.uniform(0.0, 1.0) * rng.uniform(0.8, 1.25) for n in counts})


def random_profiles(rng: random.Random, num_cores: int) -> IterationProfiles:
    def maybe() -> TaskProfile | None:
        return random_profile(rng, num_cores) if rng.random() < 0.85 else None
    return IterationProfiles(gpu=maybe(), cpu=maybe(), copy=maybe(), io=maybe())


def seconds(profile: TaskProfile | None, num_threads: int) -> float:
    return 0.0 if profile is None or num_threads == 0 else profile.seconds(num_threads)


def modelled_testbed_s(split: ThreadSplit, num_cores: int, profiles: IterationProfiles) -> float:
    """The model as stated: the GPU thread beside the CPU side, whose cores also run the copies,
    reads beside both; no task runs faster than on the cores it has."""
    rest = num_cores - split.gpu_threads
    gpu_s = seconds(profiles.gpu, split.gpu_threads)
    cpu_s = seconds(profiles.cpu, min(split.cpu_threads, rest)) + seconds(profiles.copy, min(split.copy_threads, rest))
    return max(gpu_s, cpu_s, seconds(profiles.io, split.io_threads))


def every_testbed_split(num_cores: int, copy_bytes: int, io_bytes: int):
    for gpu_threads in range(1, num_cores):
        rest = num_cores - gpu_threads
        copy_threads, io_threads = transfer_threads(rest, copy_bytes, io_bytes)
        for cpu_threads in range(1, rest + 1):
            yield ThreadSplit(gpu_threads, cpu_threads, copy_threads or rest, io_threads)


def test_the_testbed_choice_is_the_best_of_every_split():
    rng = random.Random(0)
    for _ in range(NUM_TRIALS):
        num_cores = rng.randint(2, 12)
        profiles = random_profiles(rng, num_cores)
        copy_bytes, io_bytes = rng.choice([0, 10**6, 10**8]), rng.choice([0, 10**6, 10**8])
        plan = plan_threads(num_cores, TESTBED, profiles, copy_bytes=copy_bytes, io_bytes=io_bytes)
        searched = {split: modelled_testbed_s(split, num_cores, profiles)
                    for split in every_testbed_split(num_cores, copy_bytes, io_bytes)}
        default = plan.default.split
        searched[default] = modelled_testbed_s(default, num_cores, profiles)
        best_s = min(searched.values())
        assert plan.predicted_s == pytest.approx(best_s, rel=1e-12)
        assert modelled_testbed_s(plan.split, num_cores, profiles) == pytest.approx(best_s, rel=1e-12)
        winners = [split for split, s in searched.items() if s <= best_s * (1 + 1e-9)]
        least = min(oversubscribed_threads(split, num_cores, TESTBED) for split in winners)
        winners = [split for split in winners if oversubscribed_threads(split, num_cores, TESTBED) == least]
        if default in winners:
            assert plan.split == default
        elif len(winners) == 1:
            assert plan.split == winners[0]


def test_fixed_counts_are_kept_and_the_rest_planned_around_them():
    rng = random.Random(1)
    for _ in range(NUM_TRIALS):
        num_cores = rng.randint(2, 10)
        fixed = FixedThreads(gpu_threads=rng.choice([None, rng.randint(1, num_cores - 1)]),
                             cpu_threads=rng.choice([None, rng.randint(1, num_cores)]),
                             copy_threads=rng.choice([None, rng.randint(1, 4)]),
                             io_threads=rng.choice([None, rng.randint(1, 8)]))
        plan = plan_threads(num_cores, TESTBED, random_profiles(rng, num_cores), copy_bytes=10**7,
                            io_bytes=rng.choice([0, 10**7]), fixed=fixed)
        for candidate in plan.candidates:
            for name, value in dataclasses.asdict(fixed).items():
                if value is not None:
                    assert getattr(candidate.split, name) == value


def test_a_tie_takes_fewer_readers_than_cores_over_todays_four():
    flat = TaskProfile({1: 0.01})
    plan = plan_threads(2, TESTBED, IterationProfiles(gpu=flat, cpu=flat), copy_bytes=10**6, io_bytes=10**6)
    assert plan.default.split.io_threads == 4 and plan.split == ThreadSplit(1, 1, 1, 1)


def test_a_tie_keeps_todays_split():
    flat = TaskProfile({1: 0.01})  # as fast on one thread as on many
    for num_cores in (2, 3, 8, 16):
        plan = plan_threads(num_cores, TESTBED, IterationProfiles(gpu=flat, cpu=flat), copy_bytes=10**6)
        assert plan.split == ThreadSplit(num_cores // 2, num_cores - num_cores // 2, num_cores - num_cores // 2, 0)
        assert len(plan.candidates) > 1 or num_cores == 2
    nothing_known = plan_threads(8, TESTBED, IterationProfiles())
    assert nothing_known.split == nothing_known.default.split


def test_a_testbed_without_cpu_work_gives_the_gpu_all_but_one_core():
    scaling = TaskProfile({n: 1.0 / n for n in range(1, 9)})
    plan = plan_threads(8, TESTBED, IterationProfiles(gpu=scaling))
    assert plan.split.gpu_threads == 7 and plan.split.cpu_threads == 1
    assert plan.predicted_s < plan.default.predicted_s


def test_a_slow_second_thread_is_left_out():
    """On the 2-vCPU VM two threads of one kernel can be slower than one: a measured profile says so."""
    profiles = IterationProfiles(gpu=TaskProfile({1: 0.010, 2: 0.006, 3: 0.005}),
                                 cpu=TaskProfile({1: 0.008, 2: 0.012, 3: 0.013}))
    assert plan_threads(4, TESTBED, profiles).split == ThreadSplit(2, 1, 2, 0)


def test_cuda_gives_the_cpu_side_every_core_and_plans_only_the_reader():
    reads = TaskProfile({1: 0.4, 2: 0.2, 4: 0.1, 8: 0.05})
    plan = plan_threads(16, CUDA, IterationProfiles(cpu=TaskProfile({1: 0.02, 16: 0.002}), io=reads),
                        copy_bytes=10**9, io_bytes=10**9)
    assert plan.split == ThreadSplit(0, 16, 0, 16)
    assert plan.default.split == ThreadSplit(0, 16, 0, DEFAULT_IO_THREADS)
    unread = plan_threads(16, CUDA, IterationProfiles(), io_bytes=10**9)
    assert unread.split == unread.default.split  # reads not profiled: a tie, today's count
    assert plan_threads(4, CUDA, IterationProfiles(), fixed=FixedThreads(cpu_threads=2)).split.cpu_threads == 2


def test_device_cpu_has_nothing_to_split():
    profiles = IterationProfiles(gpu=TaskProfile({1: 0.03, 4: 0.01}), cpu=TaskProfile({1: 0.002}),
                                 copy=TaskProfile({1: 0.004}))
    plan = plan_threads(4, CPU, profiles, copy_bytes=10**6)
    assert plan.split == ThreadSplit(0, 4, 1, 0) and len(plan.candidates) == 1
    assert plan.predicted_s == pytest.approx(0.01 + 0.002 + 0.004)


def test_transfer_threads_follow_the_bytes():
    assert transfer_threads(8, 0, 0) == (0, 0)
    assert transfer_threads(8, 10, 0) == (8, 0)
    assert transfer_threads(8, 0, 10) == (0, 8)
    assert transfer_threads(8, 30, 10) == (6, 2)
    assert transfer_threads(1, 30, 10) == (1, 1)  # at least one each where it moves bytes
    assert transfer_threads(3, 10, 10) == (2, 1)
    rng = random.Random(2)
    for _ in range(NUM_TRIALS):
        num_threads = rng.randint(1, 64)
        copy_threads, io_threads = transfer_threads(num_threads, rng.randint(1, 10**9), rng.randint(1, 10**9))
        assert copy_threads >= 1 and io_threads >= 1 and copy_threads + io_threads <= max(2, num_threads)


def test_profiles_interpolate_and_never_beat_the_best_measured():
    profile = TaskProfile({2: 0.010, 4: 0.006, 8: 0.005})
    assert profile.seconds(4) == 0.006
    assert profile.seconds(3) == pytest.approx(0.008)
    assert profile.seconds(1) == pytest.approx(0.020)  # the work of two threads on one
    assert profile.seconds(32) == 0.005  # flat beyond the most measured
    rng = random.Random(3)
    for _ in range(NUM_TRIALS):
        profile = random_profile(rng, 16)
        best = min(profile.seconds_by_threads.values())
        assert all(profile.seconds(n) >= best for n in range(1, 40))
        assert TaskProfile.from_dict(profile.to_dict()) == profile
    both = TaskProfile({1: 0.01, 2: 0.006}).plus(TaskProfile({1: 0.002, 4: 0.001}))
    assert both.thread_counts == (1, 2, 4)
    assert both.seconds(4) == pytest.approx(0.006 + 0.001)
    assert TaskProfile({1: 0.01}).scaled(3).seconds(1) == pytest.approx(0.03)


@pytest.mark.parametrize("make", [
    lambda: TaskProfile({}),
    lambda: TaskProfile({0: 0.1}),
    lambda: TaskProfile({1: -0.1}),
    lambda: TaskProfile({1: float("nan")}),
    lambda: TaskProfile({1: 0.1}).seconds(0),
    lambda: ThreadSplit(0, 0, 0, 0),
    lambda: FixedThreads(io_threads=0),
    lambda: plan_threads(1, TESTBED, IterationProfiles()),
    lambda: plan_threads(4, TESTBED, IterationProfiles(), fixed=FixedThreads(gpu_threads=4)),
    lambda: plan_threads(4, "tpu", IterationProfiles()),
])
def test_bad_inputs_are_value_errors(make):
    with pytest.raises(ValueError):
        make()


def test_a_plan_describes_itself_in_one_line():
    plan = plan_threads(4, TESTBED, IterationProfiles(gpu=TaskProfile({n: 1.0 / n for n in range(1, 5)})))
    text = plan.describe()
    assert "\n" not in text and "gpu 3, cpu 1, copy 1, io 0 threads" in text and "today's" in text
    assert plan.to_dict()["chosen"]["gpu_threads"] == 3
    assert default_split(4, TESTBED, (0, 0), FixedThreads()).to_dict() == dict(
        gpu_threads=2, cpu_threads=2, copy_threads=2, io_threads=0)
    assert plan.split.by_task() == {"gpu": 3, "cpu": 1, "copy": 1, "io": 0}
