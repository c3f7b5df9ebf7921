"""Greedy tokens of a MoE preset (qwen3-moe-tiny, dummy weights) with its experts sliced across
CC, CG and GG equal the tokens with every layer resident, under Neo's offloading (its two-batch
forward holds two layers' CG images at once, and CC shares the engine thread with the CPU
attention), serially and on the host-only testbed."""
import pytest

from engine import LLM, SamplingParams
from scheduler.planning import TIER_HOST
from session_cache import own_expert_statistics
from test_offload_generation import SMALL_POOLS, generate_recording_paths
from test_weight_streaming import on_testbed, slow_cost_tables

MOE_PRESET = "qwen3-moe-tiny"
NUM_LAYERS = 2
PROMPTS = [[5, 17, 301, 44], [9] * 11, [100, 200, 300, 400, 500, 7, 8], [3] * 20, [7, 8, 9]] * 2
PARAMS = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(PROMPTS)


def generate(tmp_path, device: str = "cpu", **extra) -> tuple[list, set, object]:
    """(greedy tokens per prompt, the offloading paths taken, the layer store); the expert statistics
    are the run's own, the measured profiles the session's"""
    with own_expert_statistics(tmp_path / "profiles") as profiles, \
            LLM(MOE_PRESET, load_format="dummy", dtype="float32", device=device, cpu_attention="on", **SMALL_POOLS,
                cost_tables=slow_cost_tables(tmp_path, NUM_LAYERS), profile_cache_dir=str(profiles), **extra) as llm:
        outputs, seen = generate_recording_paths(llm, PROMPTS, PARAMS)
        store = llm.engine.runner.model.layer_store
    return outputs, seen, store


@pytest.fixture(scope="module")
def resident_tokens(tmp_path_factory):
    outputs, _, _ = generate(tmp_path_factory.mktemp("resident"))
    return outputs


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed")])
def test_sliced_experts_under_neo_equal_resident(resident_tokens, tmp_path, device):
    outputs, seen, store = generate(tmp_path, device, mlp_slicing="0.25,0.25")
    assert outputs == resident_tokens
    assert "CPU decode in batch-1" in seen  # two-batch forwards held two layers' CG images at once
    assert sorted(store.moe_layers) == list(range(NUM_LAYERS))
    assert store.stats.num_cc_calls > 0
    assert store.stats.bytes_by_tier[TIER_HOST] > 0


def test_solved_expert_placement_within_a_budget_equals_resident(resident_tokens, tmp_path):
    """--mlp-slicing auto places whole experts within a budget too small for them all."""
    outputs, _, store = generate(tmp_path, mlp_slicing="auto", weights_gpu_gib=0.0012)
    assert outputs == resident_tokens
    rates = store.plan.rates
    assert any(r.gg < 1.0 for r in rates)  # the budget took experts off the GPU
    assert all(abs(rate * 8 - round(rate * 8)) < 1e-9 for r in rates for rate in (r.cc, r.cg, r.gg))
