"""EngineConfig: each section refuses a bad value when it is built, naming it as the user gave it (the
flag's keyword, or the flag); flat keywords reach their sections through one mapping; the compute
dtype is measured once, when the engine starts, and logged."""
import logging
from dataclasses import fields

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import (ACTIVATION_RESERVE_GIB, DEFAULT_PREFILL_SLOWDOWN, DEFAULT_PREFILL_STALL_MS,
                           DEPRECATED_FLAT_NAMES, FLAT_NAMES, CacheConfig, EngineConfig, CpuAttentionConfig,
                           ParallelConfig, WeightsConfig)
from engine.engine import LLMEngine
from engine.model_config import ConfigError
from engine.profiling import dtype_probe
from scheduler.neo import NeoKnobs
from scheduler.planning.slicing.rates import SliceRates
from scheduler.scheduler import SchedulerConfigError


@pytest.mark.parametrize("section, kwargs, message", [
    (CacheConfig, {"block_size": 0}, "block_size must be an integer >= 1"),
    (CacheConfig, {"num_blocks": 0}, "num_gpu_blocks must be an integer >= 1 or None"),
    (CacheConfig, {"num_cpu_blocks": 2.5}, "num_cpu_blocks must be an integer"),
    (CacheConfig, {"kv_cache_memory_gib": 0}, "kv_cache_gib must be a number > 0"),
    (CacheConfig, {"cpu_kv_cache_memory_gib": float("nan")}, "cpu_kv_cache_gib must be a number > 0"),
    (CpuAttentionConfig, {"mode": "maybe"}, "--cpu-attention must be one of auto, on, off, got 'maybe'"),
    (CpuAttentionConfig, {"gpu_threads": 0}, "gpu_threads must be an integer >= 1"),
    (CpuAttentionConfig, {"cpu_attention_threads": -2}, "cpu_attention_threads must be an integer >= 1"),
    (CpuAttentionConfig, {"profile_grid": "fine"}, "profile_grid must be one of default, quick"),
    (EngineConfig, {"dtype": "float64"}, "dtype must be auto or one of float32, fp32"),
    (EngineConfig, {"device": "tpu"}, "device must be cpu, testbed, cuda or cuda:<index>, got 'tpu'"),
    (EngineConfig, {"device": "cuda:x"}, "device must be"),
    (EngineConfig, {"seed": -1}, "seed must be an integer >= 0"),
    (EngineConfig, {"max_model_len": 0}, "max_model_len must be an integer >= 1 or None"),
    (EngineConfig, {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    (EngineConfig, {"max_num_batched_tokens": True}, "max_num_batched_tokens must be an integer"),
    (EngineConfig, {"cpu_attention": "on"},
     "cpu_attention must be of type CpuAttentionConfig, got 'on'; flat keywords go through"),
    (WeightsConfig, {"placement": "ssd"}, "placement must be one of auto, gpu, cpu, disk"),
    (WeightsConfig, {"gpu_gib": 0}, "gpu_gib must be a number > 0"),
    (WeightsConfig, {"host_gib": -1.0}, "weights_cpu_gib must be a number > 0"),
    (WeightsConfig, {"placement": "disk"}, "weight_placement disk streams every layer from files in offload_dir"),
    (WeightsConfig, {"pipeline": "fast"}, "pipeline must be one of auto, performance, memory"),
    (WeightsConfig, {"num_io_threads": 0}, "weight_io_threads must be an integer >= 1"),
    (WeightsConfig, {"mlp_slicing": "0.25"}, "--mlp-slicing must be off, auto or CC,CG"),
    (WeightsConfig, {"mlp_slicing": "0.75,0.5"}, "--mlp-slicing must be off, auto or CC,CG.*must sum to 1"),
    (WeightsConfig, {"mlp_slicing": "half,0.5"}, "--mlp-slicing must be off, auto or CC,CG"),
    (WeightsConfig, {"mlp_slicing": "-0.25,0.5"}, "--mlp-slicing must be off, auto or CC,CG.*must lie in"),
    (WeightsConfig, {"mlp_slicing": [0.25, 0.5]}, "--mlp-slicing must be off, auto, CC,CG .* or one SliceRates per layer"),
    (WeightsConfig, {"mlp_prefill_moving": "yes"}, "--mlp-prefill-moving must be one of on, off, got 'yes'"),
    (WeightsConfig, {"mlp_prefill_moving": True}, "--mlp-prefill-moving must be one of on, off, got True"),
])
def test_each_section_refuses_a_bad_value_when_built(section, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        section(**kwargs)


def test_the_neo_knobs_refuse_a_bad_value_naming_it():
    with pytest.raises(SchedulerConfigError, match="swap_in_reserve_fraction"):
        NeoKnobs(swap_in_reserve_fraction=1.0)
    with pytest.raises(SchedulerConfigError, match="swap_cooldown_iterations"):
        EngineConfig.from_flat(swap_cooldown_iterations=-1)


def test_flat_keywords_reach_their_sections():
    config = EngineConfig.from_flat(model="qwen2-0.5b", device="testbed", block_size=4, num_cpu_blocks=64,
                                    cpu_attention="on", gpu_threads=1, swap_cooldown_iterations=4,
                                    max_forced_cpu_decodes=2)
    assert (config.model, config.device) == ("qwen2-0.5b", "testbed")
    assert config.cache == CacheConfig(block_size=4, num_cpu_blocks=64)
    assert config.cpu_attention == CpuAttentionConfig(mode="on", gpu_threads=1)
    assert config.neo == NeoKnobs(swap_cooldown_iterations=4, max_forced_cpu_decodes=2)
    assert EngineConfig.from_flat() == EngineConfig()
    weights = EngineConfig.from_flat(weights_gpu_gib=2.0, weights_cpu_gib=8.0, offload_dir="/tmp/x",
                                     weight_placement="auto", weight_pipeline="memory").weights
    assert weights == WeightsConfig(gpu_gib=2.0, host_gib=8.0, offload_dir="/tmp/x", pipeline="memory")
    assert weights.streaming_requested and not WeightsConfig().streaming_requested
    with pytest.raises(ConfigError, match="--cpu-attention must be one of auto, on, off"):
        EngineConfig.from_flat(cpu_attention="sometimes")


def test_every_field_has_its_own_flat_name():
    sections = (CacheConfig, CpuAttentionConfig, NeoKnobs, WeightsConfig, ParallelConfig)
    num_top_level = len(fields(EngineConfig)) - len(sections)
    assert len(FLAT_NAMES) == num_top_level + sum(len(fields(s)) for s in sections)
    assert FLAT_NAMES["cpu_attention"] == ("cpu_attention", "mode")


def test_deprecated_flat_names_still_reach_their_fields(caplog):
    # deprecated spellings, LLM(offload="off") and such: former flags' names and former field-named keywords
    old_names = {"offload": "off", "accelerator_threads": 2, "num_blocks": 7, "kv_cache_memory_gib": 0.5,
                 "cpu_kv_cache_memory_gib": 2.0, "enable_prefix_caching": False}
    config = EngineConfig.from_flat(**old_names)
    assert (config.cpu_attention.mode, config.cpu_attention.gpu_threads) == ("off", 2)
    assert config.cache == CacheConfig(num_blocks=7, kv_cache_memory_gib=0.5, cpu_kv_cache_memory_gib=2.0,
                                       enable_prefix_caching=False)
    for old in old_names:
        assert (f"{old} is deprecated: use {DEPRECATED_FLAT_NAMES[old]}" in caplog.text) == (old not in FLAT_NAMES)
    assert set(DEPRECATED_FLAT_NAMES) == set(old_names) and not set(DEPRECATED_FLAT_NAMES.values()) & set(old_names)


def test_unknown_flat_names_are_refused_listing_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown engine arguments \['block_sise'\]; known: \[.*'block_size'"):
        EngineConfig.from_flat(block_sise=4)
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(num_gpus=2)  # refused before anything loads


@pytest.mark.parametrize("device, cpu_attention, cpu_attention_enabled", [
    ("cpu", "auto", False), ("testbed", "auto", True), ("cuda:1", "auto", True), ("cpu", "on", True),
    ("cuda", "off", False),
])
def test_offloading_follows_the_mode_and_the_device(device, cpu_attention, cpu_attention_enabled):
    config = EngineConfig.from_flat(device=device, cpu_attention=cpu_attention)
    assert config.cpu_attention_enabled is cpu_attention_enabled
    assert config.torch_device == ("cpu" if device == "testbed" else device)


def test_pool_sizes_come_from_blocks_or_memory():
    cache = CacheConfig(num_blocks=7, kv_cache_memory_gib=1.0, cpu_kv_cache_memory_gib=0.5)
    assert cache.num_gpu_blocks_for(2**20) == 7
    assert cache.num_cpu_blocks_for(2**20) == 512
    assert CacheConfig(kv_cache_memory_gib=1e-9).num_gpu_blocks_for(2**20) == 1  # never an empty pool
    assert CacheConfig().num_gpu_blocks_for(2**20) == 1024  # the 1 GiB default


def test_a_memory_budget_gives_the_pool_what_the_weights_leave():
    cache = CacheConfig(memory_gib=2.0)
    assert cache.sized_by_memory_budget and not CacheConfig(memory_gib=2.0, num_blocks=5).sized_by_memory_budget
    reserve = int(ACTIVATION_RESERVE_GIB * 2**30)
    assert cache.num_gpu_blocks_after(2**30 - reserve - 3 * 2**20, 2**20, 2.0) == 1024 + 3
    with pytest.raises(ConfigError, match="memory_gib .2. leaves no room for the KV cache.*--quantization int4"):
        cache.num_gpu_blocks_after(2 * 2**30, 2**20, 2.0)
    with pytest.raises(ConfigError, match="not both"):
        CacheConfig(memory_gib=2.0, kv_cache_memory_gib=1.0)


@pytest.fixture
def counted_probe(monkeypatch):
    """The dtype probe, counting its runs and timing bf16 at half fp32's speed; its per-process
    cache emptied before and after, so no other test sees these timings."""
    calls = []

    def probe():
        calls.append(1)
        return 1.0, 2.0  # (fp32, bf16) seconds

    dtype_probe.auto_dtype.cache_clear()
    monkeypatch.setattr(dtype_probe, "probe_matmul_times", probe)
    yield calls
    dtype_probe.auto_dtype.cache_clear()


def test_the_dtype_probe_runs_once_when_the_engine_starts_and_is_logged(counted_probe, caplog):
    config = EngineConfig.from_flat(model="smollm2-135m", load_format="dummy", dtype="auto", num_blocks=4,
                                    max_model_len=64)
    assert (config.cpu_attention_enabled, config.torch_device, config.dtype) == (False, "cpu", "auto")
    assert counted_probe == []  # building and reading a config measures nothing
    with caplog.at_level(logging.INFO, logger="engine.engine"):
        engine = LLMEngine(config)
    try:
        assert counted_probe == [1]
        assert engine.dtype == torch.float32 == engine.runner.model.dtype
        assert "compute dtype: float32 (auto: bf16 matmul 0.50x fp32's speed on this CPU" in caplog.text
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
        assert counted_probe == [1]
    finally:
        engine.close()


def test_mlp_slicing_gives_each_layer_its_rates():
    assert WeightsConfig().slice_rates(3) is None
    assert WeightsConfig(mlp_slicing="0.25,0.5").slice_rates(2) == (SliceRates(0.25, 0.5, 0.25),) * 2
    assert WeightsConfig(mlp_slicing="1,0").slice_rates(1) == (SliceRates(1.0, 0.0, 0.0),)
    per_layer = (SliceRates(1.0, 0.0, 0.0), SliceRates(0.0, 0.5, 0.5))
    assert EngineConfig.from_flat(mlp_slicing=per_layer).weights.slice_rates(2) == per_layer
    with pytest.raises(ConfigError, match="slice rates for 2 layers, but the model has 3"):
        WeightsConfig(mlp_slicing=per_layer).slice_rates(3)


def test_prefill_moving_is_on_unless_switched_off():
    assert WeightsConfig().prefill_moving
    assert not EngineConfig.from_flat(mlp_prefill_moving="off").weights.prefill_moving


def test_either_pacing_flag_turns_the_others_device_default_off():
    default = EngineConfig.from_flat(device="cpu")
    assert (default.prefill_slowdown_limit, default.prefill_stall_limit_s) == (
        DEFAULT_PREFILL_SLOWDOWN["cpu"], DEFAULT_PREFILL_STALL_MS["cpu"] / 1000)
    stall = EngineConfig.from_flat(device="cpu", max_prefill_stall_ms=400)
    assert (stall.prefill_slowdown_limit, stall.prefill_stall_limit_s) == (0.0, 0.4)
    slowdown = EngineConfig.from_flat(device="cpu", max_prefill_slowdown=0)
    assert (slowdown.prefill_slowdown_limit, slowdown.prefill_stall_limit_s) == (0.0, 0.0)
    with pytest.raises(ConfigError, match="max_prefill_stall_ms"):
        EngineConfig.from_flat(max_prefill_stall_ms=-5)
