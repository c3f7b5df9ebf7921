"""The thread probe on this machine: every task is measured at every probed count, in positive
times that more threads neither blow up nor shrink beyond what the threads could give, and the
result survives the profile cache. Times are never compared with expectations (they vary by
machine and load)."""
import math
import os
import time

import pytest
import torch

from engine.model_config import ModelConfig
from engine.profiling.cache import ProfileKey, load_or_measure
from engine.profiling.thread_probe import ThreadProfiles, measure_thread_profiles, probe_thread_counts

SMALL = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=256, intermediate_size=768,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
# How much slower a task may come out at more threads than at one, on a busy shared machine.
MAX_SLOWDOWN = 3.0
PROBE_BUDGET_S = 10.0


# A busy machine (another test process beside this one) can stall one timing; measured again then.
MAX_ATTEMPTS = 3


def scaling_faults(profiles: ThreadProfiles) -> list[str]:
    """Where more threads blow up a task's time or shrink it beyond what the threads could give."""
    faults = []
    for name, task in (("linear", profiles.linear), ("attention", profiles.attention), ("copy", profiles.copy)):
        one = task.seconds(1)
        for num_threads, elapsed in task.seconds_by_threads.items():
            # n threads do at most n times the work of one (with room for noise), and extra
            # threads do not make the task much slower (they would if they shared one core)
            if not one / (2 * num_threads) <= elapsed <= MAX_SLOWDOWN * one:
                faults.append(f"{name}: {num_threads} threads {elapsed:.2e} s against one's {one:.2e} s")
    return faults


@pytest.fixture(scope="module")
def measured():
    """(profiles, cores, the probe's seconds, scaling faults): measured again while the times are
    out of bounds, at most MAX_ATTEMPTS times."""
    cores = sorted(os.sched_getaffinity(0))
    for _ in range(MAX_ATTEMPTS):
        start = time.perf_counter()
        profiles = measure_thread_profiles(ModelConfig.from_hf_dict(SMALL), torch.float32, 16, cores)
        seconds = time.perf_counter() - start
        faults = scaling_faults(profiles)
        if not faults:
            break
    return profiles, cores, seconds, faults


def test_every_task_is_measured_at_every_probed_count(measured):
    profiles, cores, seconds, faults = measured
    assert seconds < PROBE_BUDGET_S
    for task in (profiles.linear, profiles.attention, profiles.copy):
        assert task.thread_counts == probe_thread_counts(len(cores))
        assert all(0.0 < elapsed < 1.0 for elapsed in task.seconds_by_threads.values())
    assert not faults
    config = ModelConfig.from_hf_dict(SMALL)
    assert profiles.layer_weight_bytes == profiles.copy_bytes > 4 * config.hidden_size ** 2
    assert profiles.attention_kv_bytes >= 64 * 2**20  # past the caches


def test_the_profiles_are_cached_under_their_own_kind(measured, tmp_path):
    profiles = measured[0]
    key = ProfileKey.create(model="smollm2-135m", load_format="dummy", dtype=torch.float32, device="testbed",
                            gpu_threads=1, cpu_attention_threads=2, block_size=16)
    calls = []

    def build():
        calls.append(1)
        return profiles

    for _ in range(2):
        loaded = load_or_measure(key, "threads", build, ThreadProfiles.to_dict, ThreadProfiles.from_dict, tmp_path)
        assert loaded == profiles
    assert calls == [1]


@pytest.mark.parametrize("max_threads, expected", [
    (1, (1,)), (2, (1, 2)), (8, tuple(range(1, 9))), (16, (*range(1, 9), 12, 15, 16)),
])
def test_probed_counts_are_every_small_count_then_a_ladder(max_threads, expected):
    assert probe_thread_counts(max_threads) == expected


def test_many_cores_are_probed_at_few_counts():
    counts = probe_thread_counts(256)
    assert len(counts) < 25 and counts[-2:] == (255, 256)
    assert all(b <= math.ceil(a * 1.5) for a, b in zip(counts, counts[1:]))
