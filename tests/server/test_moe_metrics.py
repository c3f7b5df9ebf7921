"""The hot-expert cache's metrics: a MoE preset (qwen3-moe-tiny, dummy weights) with 2 of its 8 experts
per layer in GPU slots generates a few tokens through the engine the way the server's loop drives
it, and /metrics' text counts every routed pair where it computed, the hot sets' changes, and one
window and hot-set series per layer and expert, as the engine's cache holds them."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import EXPERT_COPY_KINDS, EXPERT_PAIR_KINDS, Metrics
from session_cache import own_expert_statistics

MOE_PRESET = "qwen3-moe-tiny"
NUM_LAYERS, NUM_EXPERTS, TOP_K, NUM_SLOTS = 2, 8, 2, 2  # every layer routed
PROMPTS = [[5, 17, 301, 44], [9] * 11, [100, 200, 300, 400, 500, 7, 8]]
MAX_TOKENS = 4
# every prompt token once, then each sampled token but the last fed back
NUM_TOKENS = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)


def samples_of(metrics: Metrics) -> dict[str, dict[tuple, float]]:
    """Rendered /metrics: sample name -> (label values other than model_name) -> value."""
    found: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            labels = tuple(v for k, v in sorted(sample.labels.items()) if k != "model_name")
            found.setdefault(sample.name, {})[labels] = sample.value
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(metrics, engine, tokens computed) after the prompts were generated; the engine's expert
    statistics are saved under the test's directory on close."""
    from engine import LLM, SamplingParams

    profiles = tmp_path_factory.mktemp("profiles")
    with own_expert_statistics(profiles), LLM(MOE_PRESET, load_format="dummy", dtype="float32",
                                              hot_experts=str(NUM_SLOTS), profile_cache_dir=str(profiles)) as llm:
        engine = llm.engine
        metrics = Metrics(MOE_PRESET)
        metrics.watch_experts(engine.expert_heat)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for prompt in PROMPTS:
            engine.add_request(prompt, params)
        num_tokens = 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            num_tokens += engine.stats.num_batched_tokens
            metrics.record_iteration(engine, outputs, 0.0)
        yield metrics, engine, num_tokens


def test_every_routed_pair_is_counted_where_it_computed(served):
    metrics, _, num_tokens = served
    pairs = samples_of(metrics)["tandem:moe_routed_pairs_total"]
    assert num_tokens == NUM_TOKENS
    assert sum(pairs.values()) == NUM_TOKENS * TOP_K * NUM_LAYERS
    # labels sorted by name: (expert, placement); 2 of 8 experts hot: some hit, most miss
    assert pairs[("hot", "gpu")] > 0 and pairs[("cold", "cpu")] > 0
    assert pairs[("cold", "gpu")] == 0 and pairs[("hot", "cpu")] == 0  # device cpu: nothing splits, nothing fetched


def test_promotions_copy_one_expert_image_each(served):
    metrics, engine, _ = served
    found = samples_of(metrics)
    promotions = found["tandem:moe_expert_promotions_total"][()]
    demotions = found["tandem:moe_expert_demotions_total"][()]
    copied = found["tandem:moe_expert_copied_bytes_total"]
    assert promotions > 0  # the windows moved the hot sets off the first experts in index order
    assert copied[("promoted",)] == promotions * engine.runner.model.layer_store.cache.image.nbytes
    assert copied[("fetched",)] == 0
    # slots start full, so a promotion takes a demoted expert's slot (copies in flight hold one too)
    assert promotions <= demotions


def test_window_and_hot_set_series_for_every_layer_and_expert(served):
    metrics, engine, _ = served
    found = samples_of(metrics)
    window, hot = found["tandem:moe_expert_window_pairs"], found["tandem:moe_hot_expert"]
    every = {(str(expert), str(layer)) for layer in range(NUM_LAYERS) for expert in range(NUM_EXPERTS)}
    assert set(window) == set(hot) == every  # labels sorted by name: (expert, layer)
    heat = engine.expert_heat()
    for layer, entry in heat.items():
        assert [window[(str(e), str(layer))] for e in range(NUM_EXPERTS)] == entry.window_pairs
        assert {e for e in range(NUM_EXPERTS) if hot[(str(e), str(layer))] == 1} == entry.hot
        assert sum(entry.window_pairs) == NUM_TOKENS * TOP_K  # the window holds every token served
        assert 0 < len(entry.hot) <= NUM_SLOTS


def test_a_fresh_server_exports_the_counters_at_zero_and_no_heat_without_a_cache():
    metrics = Metrics("m")
    metrics.watch_experts(dict)  # a dense model's engine: no routed layers
    found = samples_of(metrics)
    assert found["tandem:moe_routed_pairs_total"] == {kind: 0.0 for kind in EXPERT_PAIR_KINDS}
    assert found["tandem:moe_expert_copied_bytes_total"] == {(kind,): 0.0 for kind in EXPERT_COPY_KINDS}
    assert found["tandem:moe_expert_promotions_total"] == {(): 0.0}
    assert found["tandem:moe_expert_demotions_total"] == {(): 0.0}
    assert "tandem:moe_expert_window_pairs" not in found and "tandem:moe_hot_expert" not in found
