"""The engine's side of the thread planner: a config and a model plan become one decode
iteration's bytes per host task, the flags' counts are kept, the probe runs (once, then from the
cache) only on the testbed, and a planned split becomes the same cores `for_device` gives for
today's split."""
import os

import pytest
import torch

from engine.config import EngineConfig
from engine.planning import threads as thread_split
from engine.device.cores import CoreAssignment, host_cores
from engine.planning.threads import (
    core_assignment,
    fixed_threads,
    iteration_profiles,
    iteration_volumes,
    plan_thread_split,
)
from engine.planning.weights import weight_format
from engine.profiling.thread_probe import ThreadProfiles
from engine.weights import create_loader
from scheduler.planning import LayerPlan, ModelPlan, SliceRates, Tier, layer_image_bytes
from scheduler.planning.memory import linear_shapes
from scheduler.planning.threads import TESTBED, FixedThreads, TaskProfile, ThreadSplit

MODEL = dict(model="smollm2-135m", load_format="dummy", dtype="float32")
MAX_MODEL_LEN = 1024
TWO_CORES = len(host_cores()) >= 2
on_testbed = pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")


@pytest.fixture(scope="module")
def model_config():
    return create_loader(MODEL["model"], MODEL["load_format"]).config


def config(**flat) -> EngineConfig:
    return EngineConfig.from_flat(**MODEL, max_model_len=MAX_MODEL_LEN, **{"quantization": "none", **flat})  # as fitted


def layer_parts(model_config, engine_config) -> tuple[int, int]:
    """(attention weight bytes, stored MLP bytes) of one layer."""
    fmt = weight_format(engine_config, torch.float32)
    shapes = linear_shapes(model_config.shape)
    attention = sum(sum(fmt.linear_tensor_bytes(*shapes[name])) for name in ("qkv", "o_proj"))
    return attention, layer_image_bytes(model_config.shape, fmt) - attention


def profiles(linear_s: dict[int, float], attention_s: dict[int, float], copy_s: dict[int, float]) -> ThreadProfiles:
    return ThreadProfiles(TaskProfile(linear_s), 10**7, TaskProfile(attention_s), 10**8, TaskProfile(copy_s), 10**7)


def test_a_resident_model_on_the_cpu_is_all_gpu_linear_work(model_config):
    engine_config = config(device="cpu", cpu_attention="off")
    plan = ModelPlan.compose(model_config.num_layers)
    volumes = iteration_volumes(engine_config, model_config, torch.float32, plan, MAX_MODEL_LEN)
    attention, mlp = layer_parts(model_config, engine_config)
    assert volumes.gpu_weight_bytes == model_config.num_layers * (attention + mlp)
    assert (volumes.cc_weight_bytes, volumes.cpu_kv_bytes, volumes.copy_bytes, volumes.io_bytes) == (0, 0, 0, 0)


def test_each_layer_counts_by_its_plan(model_config):
    engine_config = config(device="testbed", cpu_attention="off")
    rates = SliceRates(0.25, 0.25, 0.5)
    num_layers = model_config.num_layers
    layers = (LayerPlan(Tier.HOST), LayerPlan(Tier.DISK)) + (LayerPlan(Tier.GPU, rates),) * (num_layers - 2)
    volumes = iteration_volumes(engine_config, model_config, torch.float32, ModelPlan(layers), MAX_MODEL_LEN)
    attention, mlp = layer_parts(model_config, engine_config)
    num_sliced = num_layers - 2
    assert volumes.cc_weight_bytes == round(num_sliced * 0.25 * mlp)
    assert volumes.copy_bytes == round(2 * (attention + mlp) + num_sliced * 0.25 * mlp)
    assert volumes.io_bytes == attention + mlp
    assert volumes.gpu_weight_bytes == round(2 * (attention + mlp) + num_sliced * (attention + 0.75 * mlp))


def test_the_cpu_attention_reads_what_the_host_pool_holds(model_config):
    kv_bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 4
    small_pool = config(device="testbed", cpu_attention="on", num_cpu_blocks=256, max_num_seqs=64)
    volumes = iteration_volumes(small_pool, model_config, torch.float32, ModelPlan.compose(model_config.num_layers),
                                MAX_MODEL_LEN)
    num_seqs = 256 * 16 // MAX_MODEL_LEN  # sequences of max_model_len tokens the pool holds
    assert volumes.cpu_kv_bytes == num_seqs * MAX_MODEL_LEN * kv_bytes_per_token


def test_the_probes_units_scale_to_the_iteration():
    measured = profiles({1: 0.002, 2: 0.001}, {1: 0.010, 2: 0.006}, {1: 0.003, 2: 0.002})
    volumes = thread_split.IterationVolumes(gpu_weight_bytes=3 * 10**7, cc_weight_bytes=10**7, cpu_kv_bytes=2 * 10**8,
                                            copy_bytes=5 * 10**7, io_bytes=0)
    work = iteration_profiles(measured, volumes, TESTBED)
    assert work.gpu.seconds(1) == pytest.approx(0.006)
    assert work.cpu.seconds(2) == pytest.approx(0.001 + 0.012)
    assert work.copy.seconds(1) == pytest.approx(0.015)
    on_cuda = iteration_profiles(measured, volumes, "cuda")
    assert on_cuda.gpu is None and on_cuda.copy is None and on_cuda.cpu.seconds(1) == pytest.approx(0.022)


def test_the_flags_fix_their_counts():
    assert fixed_threads(config(device="testbed", gpu_threads=1, cpu_attention_threads=3, weight_io_threads=2),
                         copy_threads=5) == FixedThreads(1, 3, 5, 2)
    # device cpu: --cpu-attention-threads is the kernel's inside the serial forward, not the CPU side's
    assert fixed_threads(config(device="cpu", cpu_attention_threads=3)).cpu_threads is None
    assert fixed_threads(config(device="cuda", gpu_threads=2)).gpu_threads is None


@on_testbed
def test_the_testbed_is_probed_once_then_planned_from_the_cache(model_config, tmp_path, monkeypatch):
    calls = []
    measured = profiles({n: 0.004 / n for n in range(1, 3)}, {1: 0.002}, {1: 0.001})

    def probe(*args):
        calls.append(args)
        return measured
    monkeypatch.setattr(thread_split, "measure_thread_profiles", probe)
    engine_config = config(device="testbed", cpu_attention="off", profile_cache_dir=str(tmp_path))
    plan = ModelPlan.compose(model_config.num_layers)
    first = plan_thread_split(engine_config, model_config, torch.float32, plan, MAX_MODEL_LEN)
    second = plan_thread_split(engine_config, model_config, torch.float32, plan, MAX_MODEL_LEN)
    assert len(calls) == 1 and first == second
    assert first.predicted_s > 0 and len(list(tmp_path.glob("*.threads.json"))) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_nothing_is_probed_where_nothing_is_split(model_config, device, monkeypatch):
    monkeypatch.setattr(thread_split, "measure_thread_profiles", lambda *args: pytest.fail("probed"))
    plan = plan_thread_split(config(device=device, cpu_attention="off"), model_config, torch.float32,
                             ModelPlan.compose(model_config.num_layers), MAX_MODEL_LEN)
    assert plan.split == plan.default.split and plan.split.cpu_threads == len(host_cores())


@on_testbed
def test_fixed_counts_survive_planning(model_config):
    measured = profiles({1: 0.004, 2: 0.002}, {1: 0.003, 2: 0.002}, {1: 0.001})
    engine_config = config(device="testbed", cpu_attention="on", gpu_threads=1, cpu_attention_threads=1,
                           weight_io_threads=3)
    plan = plan_thread_split(engine_config, model_config, torch.float32, ModelPlan.compose(model_config.num_layers),
                             MAX_MODEL_LEN, copy_threads=2, profiles=measured)
    assert plan.split == ThreadSplit(1, 1, 2, 3)


@pytest.mark.parametrize("device", [
    pytest.param("testbed", marks=on_testbed), "cpu", "cuda",
])
def test_todays_split_gives_todays_cores(model_config, device):
    engine_config = config(device=device)
    plan = plan_thread_split(engine_config, model_config, torch.float32, ModelPlan.compose(model_config.num_layers),
                             MAX_MODEL_LEN, profiles=profiles({1: 0.001}, {1: 0.001}, {1: 0.001}))
    today = CoreAssignment.for_device(device)
    planned = core_assignment(engine_config, plan.default.split)
    assert (planned.gpu_cores, planned.cpu_attention_cores, planned.cpu_attention_threads) == (
        today.gpu_cores, today.cpu_attention_cores, today.cpu_attention_threads)
    if device != "cuda":  # a CUDA copy engine takes no host threads, whatever the count
        assert planned.copy_threads == today.copy_threads


@on_testbed
def test_a_testbed_split_must_leave_the_cpu_side_a_core():
    with pytest.raises(ValueError, match="leaves no core"):
        CoreAssignment.from_split("testbed", ThreadSplit(len(host_cores()), 1, 1, 0))
    split = ThreadSplit(1, 1, 3, 0)
    cores = CoreAssignment.from_split("testbed", split)
    assert len(cores.gpu_cores) == 1 and cores.copy_threads == 3 and not cores.gpu_cores & cores.cpu_attention_cores
    assert cores.gpu_cores | cores.cpu_attention_cores == set(os.sched_getaffinity(0))
