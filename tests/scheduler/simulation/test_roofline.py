"""Roofline cost model and hardware profiles: the shipped profiles load, bad files fail with a
readable error, stage times grow the way the hardware says, pools are sized sanely. No torch."""
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from engine.model_config import load_model_preset
from scheduler.planning.cost_model import kv_bytes_per_token
from scheduler.simulation.roofline import (GIB, GPU_MEMORY_UTILIZATION, HARDWARE_DIR, HardwareProfile, HardwareProfileError,
                                PoolSizingError, RooflineCostModel, list_hardware_profiles, size_pools, weight_bytes)

# Neo's three machines and the model each one ran (Neo section 5.1).
NEO_SETUPS = [("t4-g4dn.4xlarge", "llama-2-7b"), ("a10g-g5.4xlarge", "llama-3.1-8b"),
              ("2xh100-xeon8462y", "llama-3.1-70b")]


def cost_model(profile, model):
    shape, dtype_bytes = load_model_preset(model)
    return RooflineCostModel(shape, HardwareProfile.load(profile), dtype_bytes)


def profile_dict(name="t4-g4dn.4xlarge"):
    """A shipped profile as its JSON dict, to break in a copy."""
    return json.loads((HARDWARE_DIR / f"{name}.json").read_text())


def pools_for(profile, model):
    shape, dtype_bytes = load_model_preset(model)
    return size_pools(shape, HardwareProfile.load(profile), dtype_bytes=dtype_bytes)


def test_roofline_and_simulator_do_not_import_torch():
    code = "import sys, scheduler.simulation.roofline, scheduler.simulation.simulator; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- profiles ----------------------------------------------------------------------------------
def test_neo_profiles_ship_and_load():
    assert {p for p, _ in NEO_SETUPS} <= set(list_hardware_profiles())
    for name in list_hardware_profiles():
        profile = HardwareProfile.load(name)
        assert profile.name == name
        assert profile.gpu_bandwidth < profile.gpu_memory_bandwidth_gbps * 1e9  # efficiencies applied
    h100 = HardwareProfile.load("2xh100-xeon8462y")
    assert h100.num_gpus == 2 and h100.interconnect_gbps > 0


def test_profile_load_by_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**profile_dict(), "name": "mine"}))
    assert HardwareProfile.load(path).name == "mine"


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "broken", ')
    with pytest.raises(HardwareProfileError, match="broken.json: not valid JSON"):
        HardwareProfile.load(path)


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(HardwareProfileError, match="unknown hardware profile 'v100'.*a10g-g5.4xlarge"):
        HardwareProfile.load("v100")


@pytest.mark.parametrize("change, message", [
    ({"gpu_memory_bandwidth_gbps": -320}, "gpu_memory_bandwidth_gbps must be a number > 0"),
    ({"pcie_gbps": "fast"}, "pcie_gbps must be a number > 0"),
    ({"host_bandwidth_efficiency": 1.5}, r"host_bandwidth_efficiency is a fraction of a peak and must be in \(0, 1\]"),
    ({"num_gpus": 0}, "num_gpus must be an integer >= 1"),
    ({"num_gpus": 2}, "interconnect_gbps must be > 0 with 2 GPUs"),
    ({"cpu_name": ""}, "cpu_name must be a non-empty string"),
    ({"turbo": True}, r"unknown fields \['turbo'\]"),
])
def test_invalid_profile_names_the_field(tmp_path, change, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**profile_dict(), **change}))
    with pytest.raises(HardwareProfileError, match=message):
        HardwareProfile.load(path)


def test_missing_field_and_missing_note_are_named(tmp_path):
    data = profile_dict()
    del data["host_tflops"]
    path = tmp_path / "short.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareProfileError, match=r"missing fields \['host_tflops'\]"):
        HardwareProfile.load(path)
    data = profile_dict()
    del data["notes"]["pcie_gbps"]
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareProfileError, match=r"must say where each number comes from; missing \['pcie_gbps'\]"):
        HardwareProfile.load(path)


# ---- stage times ---------------------------------------------------------------------------------
@pytest.mark.parametrize("profile, model", NEO_SETUPS)
def test_times_grow_with_work(profile, model):
    cost = cost_model(profile, model)
    tokens = [1, 2, 16, 64, 128, 256, 512, 1024, 4096, 16384]
    linear = [cost.linear(n) for n in tokens]
    assert all(b >= a for a, b in zip(linear, linear[1:])) and linear[-1] > linear[0]
    for attention in (cost.gpu_decode_attention, cost.cpu_decode_attention):
        times = [attention(4, context) for context in (16, 256, 4096, 65536)]
        assert all(b > a for a, b in zip(times, times[1:]))
    assert cost.cpu_decode_attention(8, 4096) > cost.cpu_decode_attention(1, 4096)  # per-sequence costs
    prefill = [cost.prefill_attention([n]) for n in (16, 256, 2048, 8192)]
    assert all(b > a for a, b in zip(prefill, prefill[1:]))
    assert cost.prefill_attention([512, 512]) == pytest.approx(2 * cost.prefill_attention([512]))
    assert cost.head(256) >= cost.head(1) > 0
    assert cost.swap(10) == pytest.approx(10 * cost.swap(1)) and cost.swap(0) == 0
    for empty in (cost.linear(0), cost.gpu_decode_attention(0, 0), cost.cpu_decode_attention(0, 0),
                  cost.head(0), cost.prefill_attention([])):
        assert empty == 0


@pytest.mark.parametrize("profile, model", NEO_SETUPS)
def test_linear_is_weight_bound_for_small_batches_and_flop_bound_for_large(profile, model):
    cost = cost_model(profile, model)
    ridge = cost.linear_ridge_tokens
    assert 50 < ridge < 1000  # fp16 GPUs: tens to hundreds of FLOPs per weight byte
    # below the ridge the weights dominate: a batch of half the ridge costs about one token's time
    # (the tensor-parallel all-reduce still grows a little with tokens)
    assert cost.linear(int(ridge / 2)) == pytest.approx(cost.linear(1), rel=0.05)
    # far above it time is proportional to tokens
    big = int(16 * ridge)
    assert cost.linear(2 * big) / cost.linear(big) == pytest.approx(2, rel=0.02)


@pytest.mark.parametrize("profile, model", NEO_SETUPS)
def test_decode_attention_is_memory_bound_and_slower_on_the_cpu(profile, model):
    cost = cost_model(profile, model)
    assert cost.cpu_attention_memory_bound  # even 8 query heads per KV head stay under the host's FLOPs
    hw, shape = cost.hardware, cost.shape
    context = 1 << 20
    kv_bytes = context * shape.kv_bytes_per_token_layer(cost.dtype_bytes)
    assert cost.cpu_decode_attention(1, context) == pytest.approx(kv_bytes / hw.host_bandwidth, rel=0.01)
    assert cost.gpu_decode_attention(1, context) == pytest.approx(kv_bytes / (hw.num_gpus * hw.gpu_bandwidth),
                                                                  rel=0.01)
    assert cost.cpu_decode_attention(1, context) > 4 * cost.gpu_decode_attention(1, context)


def test_tensor_parallelism_splits_the_gpu_work_but_not_the_host():
    shape, dtype_bytes = load_model_preset("llama-3.1-70b")
    two = HardwareProfile.load("2xh100-xeon8462y")
    one = replace(two, num_gpus=1, interconnect_gbps=0.0)
    cost1, cost2 = RooflineCostModel(shape, one, dtype_bytes), RooflineCostModel(shape, two, dtype_bytes)
    # weight-bound linear: half the bytes per GPU, plus the two all-reduces
    assert cost2.linear(1) < 0.6 * cost1.linear(1)
    assert cost2.gpu_decode_attention(1, 2_000_000) == pytest.approx(cost1.gpu_decode_attention(1, 2_000_000) / 2,
                                                                   rel=0.01)
    assert cost2.swap(100) == pytest.approx(cost1.swap(100) / 2)  # each GPU moves its own KV heads
    # CPU attention reads the same bytes from the same NUMA node either way
    assert cost2.cpu_decode_attention(1, 2_000_000) == pytest.approx(cost1.cpu_decode_attention(1, 2_000_000), rel=0.01)


def test_cost_model_rejects_bad_sizes():
    shape, _ = load_model_preset("llama-2-7b")
    with pytest.raises(ValueError, match="dtype_bytes must be an integer >= 1"):
        RooflineCostModel(shape, HardwareProfile.load("t4-g4dn.4xlarge"), 0)


# ---- pool sizing ----------------------------------------------------------------------------------
def test_kv_bytes_per_token_is_k_and_v_of_every_layer():
    # Llama-2-7B in fp16: 2 (K, V) x 32 layers x 32 KV heads x 128 dims x 2 bytes = 512 KiB a token
    assert kv_bytes_per_token(32, 32, 128, 2) == 512 * 1024
    # Llama-3.1-8B in bf16, 8 KV heads (GQA): 128 KiB a token, 4 KiB of it in each layer
    shape, dtype_bytes = load_model_preset("llama-3.1-8b")
    assert kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes) == 128 * 1024
    assert shape.kv_bytes_per_token_layer(dtype_bytes) == 4 * 1024
    assert size_pools(shape, HardwareProfile.load("a10g-g5.4xlarge"), dtype_bytes=dtype_bytes,
                      block_size=16).block_bytes == 16 * 128 * 1024


@pytest.mark.parametrize("model, billions", [("llama-2-7b", 6.74), ("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.6)])
def test_weights_match_the_published_parameter_counts(model, billions):
    shape, _ = load_model_preset(model)
    assert weight_bytes(shape, 1) / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("profile, model", NEO_SETUPS)
def test_pools_fit_the_memory(profile, model):
    hw = HardwareProfile.load(profile)
    pools = pools_for(profile, model)
    budget = hw.num_gpus * hw.gpu_memory_gib * GPU_MEMORY_UTILIZATION
    used = pools.weight_gib + pools.activation_gib + pools.num_gpu_blocks * pools.block_bytes / GIB
    assert budget - pools.block_bytes / GIB < used <= budget
    assert pools.num_cpu_blocks * pools.block_bytes / GIB <= hw.host_memory_gib / 2
    assert pools.num_cpu_blocks > 4 * pools.num_gpu_blocks  # the host pool is the big one


def test_pool_sizes_match_what_the_machines_are_known_for():
    t4, a10g, h100 = (pools_for(profile, model) for profile, model in NEO_SETUPS)
    # a 7B model leaves a T4 room for only a couple of 500-token seqs: Neo's motivating case
    assert 500 < t4.num_gpu_blocks * 16 < 4000
    assert 20_000 < a10g.num_gpu_blocks * 16 < 80_000
    assert 20_000 < h100.num_gpu_blocks * 16 < 80_000


def test_a_model_that_does_not_fit_is_a_clear_error():
    shape, dtype_bytes = load_model_preset("llama-3.1-70b")
    with pytest.raises(PoolSizingError, match="t4-g4dn.4xlarge: 131.4 GiB of weights"):
        size_pools(shape, HardwareProfile.load("t4-g4dn.4xlarge"), dtype_bytes=dtype_bytes)
