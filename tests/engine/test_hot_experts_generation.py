"""Greedy tokens of a MoE preset (qwen3-moe-tiny, dummy weights) through the hot-expert cache equal
the tokens with every expert resident, while the hot sets change between steps (promotions by
background copies, demotions without), with misses fetched onto the GPU, under Neo's two-batch
forward, serially and on the host-only testbed; the budget sizes the slots with no MoE flag, and a
run's statistics choose the next run's first hot sets."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.offload.experts import hot_moe
from engine.offload.experts.store import HotExpertLayers
from scheduler.planning import PlacementError
from scheduler.planning.experts.split import ExpertSplit
from session_cache import own_expert_statistics
from test_offload_generation import SMALL_POOLS, generate_recording_paths
from test_weight_streaming import TWO_CORES, on_testbed, slow_cost_tables

MOE_PRESET = "qwen3-moe-tiny"  # 2 layers of 8 experts, top-2
NUM_LAYERS, NUM_EXPERTS = 2, 8
PROMPTS = [[5, 17, 301, 44], [9] * 11, [100, 200, 300, 400, 500, 7, 8], [3] * 20, [7, 8, 9]] * 2
PARAMS = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * len(PROMPTS)


def engine_args(tmp_path, device: str = "cpu", neo: bool = False) -> dict:
    """The engine's keywords; its profile cache is tmp_path/profiles (see `own_profiles`)."""
    args = dict(load_format="dummy", dtype="float32", device=device, profile_cache_dir=str(tmp_path / "profiles"))
    if neo:
        args.update(cpu_attention="on", cost_tables=slow_cost_tables(tmp_path, NUM_LAYERS), **SMALL_POOLS)
    else:
        args.update(cpu_attention="off")
    return args


@pytest.fixture(autouse=True)
def own_profiles(tmp_path):
    """Each test's engines keep their expert statistics in a profile cache of the test's own (a run
    seeds the next run's first hot sets), which shares the session's measurements (the slicing
    costs take half a minute to measure)."""
    with own_expert_statistics(tmp_path / "profiles"):
        yield


@pytest.fixture(scope="module")
def resident_tokens(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resident")
    with own_expert_statistics(tmp_path / "profiles"), LLM(MOE_PRESET, **engine_args(tmp_path)) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def resident_neo_tokens(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("resident-neo")
    with own_expert_statistics(tmp_path / "profiles"), LLM(MOE_PRESET, **engine_args(tmp_path, neo=True)) as llm:
        return generate_recording_paths(llm, PROMPTS, PARAMS)[0]


def churn_between_steps(store: HotExpertLayers, seed: int = 0) -> list[dict]:
    """After every forward, demote a random resident expert of each layer and promote a random
    other one (the policy frozen), waiting for the copies on every third step so some land while
    forwards run and some before. -> the hot sets seen at each step"""
    rng, cache, seen = random.Random(seed), store.cache, []
    cache.frozen = True
    between = store.between_forwards

    def churn():
        between()
        for layer, entry in cache.layers.items():
            resident = sorted(entry.slot_of)
            if resident:
                cache.demote(layer, rng.choice(resident))
            cache.promote(layer, rng.choice([e for e in range(NUM_EXPERTS) if e not in entry.slot_of]))
        if len(seen) % 3 == 0:
            cache.settle()
        seen.append({layer: sorted(heat.hot) for layer, heat in cache.heat().items()})

    store.between_forwards = churn
    return seen


@pytest.mark.parametrize("device,piecewise", [
    ("cpu", False), on_testbed("testbed", True),
    pytest.param("testbed", False, marks=[pytest.mark.slow, *on_testbed().marks])])  # make test's 14 minutes
def test_hot_sets_changing_every_step_give_the_resident_tokens(resident_tokens, tmp_path, monkeypatch, device,
                                                               piecewise):
    """`piecewise`: every forward takes a prefill's path (each side weights its outputs, each expert's
    summed as it is), which the small preset's batches would not reach."""
    if piecewise:
        monkeypatch.setattr(hot_moe, "PIECEWISE_MIN_PAIRS", 1)
    with LLM(MOE_PRESET, hot_experts="3", **engine_args(tmp_path, device)) as llm:
        store = llm.engine.runner.model.layer_store
        seen = churn_between_steps(store)
        outputs = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.weight_stats
    assert outputs == resident_tokens
    assert len({str(hot) for hot in seen}) > 5  # the hot sets really moved
    assert stats.num_expert_promotions > 10 and stats.num_expert_demotions > 10
    assert stats.num_hit_pairs > 0 and stats.num_miss_pairs > 0 and stats.num_cc_calls > 0
    routed = sum(len(p) + 15 for p in PROMPTS) * 2 * NUM_LAYERS  # every token, top-2, each routed layer
    assert stats.num_hit_pairs + stats.num_miss_pairs == routed


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed")])
def test_the_policy_promotes_while_serving_and_keeps_the_resident_tokens(resident_neo_tokens, tmp_path, device):
    """Neo's two-batch forward (CPU decodes beside the GPU's), the windows choosing the hot sets."""
    with LLM(MOE_PRESET, hot_experts="2", expert_window_tokens=16, **engine_args(tmp_path, device, neo=True)) as llm:
        outputs, seen = generate_recording_paths(llm, PROMPTS, PARAMS)
        stats = llm.engine.weight_stats
    assert outputs == resident_neo_tokens
    assert "CPU decode in batch-1" in seen
    assert stats.num_expert_promotions > 0


def forced_split(hit_rows, miss_rows, max_fetches):
    """Every miss the fetch buffers have room for fetched, every other hit computed by the CPU."""
    return ExpertSplit(list(range(min(len(miss_rows), max_fetches))), list(range(0, len(hit_rows), 2)))


@pytest.mark.skipif(not TWO_CORES, reason="the testbed needs 2 cores")
@pytest.mark.parametrize("piecewise", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fetched_misses_and_hits_on_the_cpu_give_the_resident_tokens(resident_tokens, tmp_path, monkeypatch,
                                                                      piecewise):
    if piecewise:
        monkeypatch.setattr(hot_moe, "PIECEWISE_MIN_PAIRS", 1)
    with LLM(MOE_PRESET, hot_experts="3", **engine_args(tmp_path, "testbed")) as llm:
        store = llm.engine.runner.model.layer_store
        store.split_model.split = forced_split
        outputs = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
        stats = llm.engine.weight_stats
    assert outputs == resident_tokens
    assert stats.num_fetched_pairs > 0 and stats.fetched_bytes > 0 and stats.num_hit_pairs_on_cpu > 0
    assert stats.expert_copy_thread_ids  # copied by the fetch thread, not the GPU's
    assert all(fit.read != 1.0 for fit in store.split_model.fits.values())  # both sides timed


def test_a_budget_alone_sizes_the_slots_and_a_run_seeds_the_next(resident_tokens, tmp_path):
    """No MoE flag: --weights-gpu-gib below the experts' size gives the cache; the first run's
    windows choose the second run's first hot sets."""
    budget_gib = 0.0011  # the non-expert weights, four fetch buffers and a few experts per layer
    with LLM(MOE_PRESET, weights_gpu_gib=budget_gib, **engine_args(tmp_path)) as llm:
        store = llm.engine.runner.model.layer_store
        assert isinstance(store, HotExpertLayers)
        assert 0 < store.plan.num_slots < NUM_EXPERTS
        assert store.plan.gpu_bytes <= budget_gib * 2**30
        outputs = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
        windows = {layer: heat.window_pairs for layer, heat in store.cache.heat().items()}
    assert outputs == resident_tokens
    with LLM(MOE_PRESET, weights_gpu_gib=budget_gib, **engine_args(tmp_path)) as llm:
        cache = llm.engine.runner.model.layer_store.cache
        for layer, counts in windows.items():
            hottest = sorted(range(NUM_EXPERTS), key=lambda e: (-counts[e], e))[:cache.num_slots]
            assert sorted(cache.layers[layer].slot_of) == sorted(hottest)


def test_a_budget_too_small_for_the_non_expert_weights_is_refused(tmp_path):
    with pytest.raises(PlacementError, match="--weights-gpu-gib"):
        LLM(MOE_PRESET, weights_gpu_gib=0.0001, **engine_args(tmp_path))


def test_the_fit_gives_a_moe_model_over_the_gpu_budget_the_cache(resident_tokens, tmp_path):
    """--gpu-memory-gib alone, below the weights: the cache in most of it, the KV pool in the rest."""
    with LLM(MOE_PRESET, gpu_memory_gib=0.002, **engine_args(tmp_path)) as llm:
        assert isinstance(llm.engine.runner.model.layer_store, HotExpertLayers)
        assert llm.engine.config.weights.gpu_gib == pytest.approx(0.0016)
        outputs = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
    assert outputs == resident_tokens

