"""Greedy tokens of the embedded model with every layer's MLP sliced (ScheInfer's CC/CG/GG) equal
the tokens with every layer resident: Neo's offloading off and on (its two-batch forward holds two
layers' CG parts at once, and the CPU attention and CC share the engine thread), serially and on
the host-only testbed, and beside PIPO's whole-layer streaming. Each run checks that the CPU
computed its parts and that CG parts were copied. Prefill token assignment (CG') is on in all of
them, as solved (on device cpu this machine's models move every prefill token), forced to move
half of every forward's tokens under Neo's two-batch forward on the testbed, and off."""
import pytest

import engine.engine
from engine import LLM
from engine.offload.slicing.sliced_mlp import DENSE_SLICE_UNITS
from engine.weights import create_loader
from scheduler.planning import TIER_GPU, TIER_DISK, TIER_HOST
from scheduler.planning.slicing.moved_tokens import SolvedMovedTokens
from scheduler.planning.slicing.rates import SliceRates
from test_offload_generation import SMALL_POOLS
import test_weight_streaming
from test_weight_streaming import EMBEDDED, EMBEDDED_INT4, generate, on_testbed, slow_cost_tables, tier_budgets, workload

SLICING = "0.25,0.5"


def run_sliced(model: dict, tmp_path, device: str, cpu_attention: str, slicing=SLICING, **extra) -> tuple[list, set,
                                                                                                          set]:
    """(token ids per prompt, whether a batch-1 ran, the layers' tiers), checking that the CPU
    computed CC for the tokens CG' did not compute it for"""
    kwargs = dict(model, device=device, cpu_attention=cpu_attention, mlp_slicing=slicing, **extra)
    if cpu_attention == "on":
        num_layers = create_loader(model["model"]).config.num_layers
        kwargs.update(SMALL_POOLS, cost_tables=slow_cost_tables(tmp_path, num_layers))
    with LLM(**kwargs) as llm:
        outputs, seen = generate(llm, *workload(model, cpu_attention))
        store = llm.engine.runner.model.layer_store
        rates = llm.engine.config.weights.slice_rates(len(store.tiers))
        assert store.mlps
        stats = llm.engine.weight_stats
        if any(r.cc for r in rates):
            assert stats.num_cc_tokens + stats.num_moved_tokens >= len(store.mlps) * len(workload(model,
                                                                                                  cpu_attention)[0])
            assert stats.cc_s > 0 or stats.num_moved_tokens > 0
        # device cpu moves nothing: one thread computes both sides in turn
        assert (store.moved is not None) == (llm.engine.config.weights.prefill_moving and device != "cpu")
        if any(r.cg for r in rates):
            assert stats.bytes_by_tier[TIER_HOST] > 0
        tiers = {tier for (_, tier) in llm.engine.runner.model.weight_bytes()}
        assert {TIER_GPU, TIER_HOST} <= tiers
        layer_tiers = set(store.tiers)
    return outputs, seen, layer_tiers


@pytest.mark.parametrize("device, cpu_attention", [  # make test: one serial run, one under Neo's two batches
    ("cpu", "off"), pytest.param("cpu", "on", marks=pytest.mark.slow), on_testbed("testbed", "off", slow=True),
    on_testbed("testbed", "on"),
])
def test_embedded_model_sliced_equals_resident(references, tmp_path, device, cpu_attention):
    outputs, seen, _ = run_sliced(EMBEDDED, tmp_path, device, cpu_attention)
    assert outputs == references(EMBEDDED, cpu_attention)
    if cpu_attention == "on":
        assert "batch-1" in seen  # two-batch forwards held two layers' CG parts at once


class HalfMoved(SolvedMovedTokens):
    """Half of every forward's tokens, whatever the models say (this machine's move none on the
    testbed): CG' runs in every sliced layer with CC of every forward of two tokens or more."""

    def count(self, layer: int, num_tokens: int) -> int:
        return num_tokens // 2


@pytest.mark.skipif(not test_weight_streaming.TWO_CORES, reason="the testbed needs 2 cores")
def test_embedded_model_with_moved_tokens_under_neo_equals_resident(references, tmp_path, monkeypatch):
    """CG' copied on the transfer thread and computed on the GPU thread while Neo's
    two-batch forward holds two layers, beside CC on the engine thread; the iterations report
    how many tokens moved."""
    monkeypatch.setattr(engine.engine, "SolvedMovedTokens", HalfMoved)
    moved_per_iteration = []
    record = engine.engine.LLMEngine._record_weights

    def recording(stats, before, after):
        record(stats, before, after)
        moved_per_iteration.append(stats.num_mlp_moved_tokens)

    monkeypatch.setattr(engine.engine.LLMEngine, "_record_weights", staticmethod(recording))
    outputs, seen, _ = run_sliced(EMBEDDED, tmp_path, "testbed", "on")
    assert outputs == references(EMBEDDED, "on")
    assert "batch-1" in seen
    assert max(moved_per_iteration) > 0


@pytest.mark.parametrize("device", [on_testbed("testbed")])  # device cpu never moves tokens
def test_embedded_model_without_moved_tokens_equals_resident(references, tmp_path, device):
    outputs, _, _ = run_sliced(EMBEDDED, tmp_path, device, "off", mlp_prefill_moving="off")
    assert outputs == references(EMBEDDED, "off")


def alternating_rates(num_layers: int) -> tuple[SliceRates, ...]:
    """A per-layer mix: all CPU, all streamed, half and half, mixed, round the layers."""
    mixes = (SliceRates(1.0, 0.0, 0.0), SliceRates(0.0, 1.0, 0.0), SliceRates(0.5, 0.0, 0.5),
             SliceRates(0.25, 0.5, 0.25))
    return tuple(mixes[i % len(mixes)] for i in range(num_layers))


def test_embedded_model_at_per_layer_rates_equals_resident(references, tmp_path):
    """All CPU, all streamed and mixed layers in one run (each rate alone is a layer of this mix)."""
    slicing = alternating_rates(create_loader(EMBEDDED["model"]).config.num_layers)
    outputs, _, _ = run_sliced(EMBEDDED, tmp_path, "cpu", "off", slicing)
    assert outputs == references(EMBEDDED, "off")


def test_embedded_int4_sliced_equals_resident(references, tmp_path):
    """Q4_1 blocks cut on their groups of 32; serial (device cpu): INT4 does not run on the testbed."""
    outputs, _, _ = run_sliced(EMBEDDED_INT4, tmp_path, "cpu", "off")
    assert outputs == references(EMBEDDED_INT4, "off")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed")])
def test_sliced_beside_streamed_layers_equals_resident(references, tmp_path, device):
    """PIPO streams some layers whole from host memory or disk; the resident ones are sliced."""
    budgets = tier_budgets(EMBEDDED, "mixed")
    outputs, seen, layer_tiers = run_sliced(EMBEDDED, tmp_path, device, "on", offload_dir=str(tmp_path / "offload"),
                                            **budgets)
    assert layer_tiers == {TIER_GPU, TIER_HOST, TIER_DISK}  # whole layers streamed beside sliced ones
    assert outputs == references(EMBEDDED, "on")
    assert "batch-1" in seen


@pytest.mark.parametrize("device", ["cpu", on_testbed("testbed")])
def test_solved_rates_within_the_budget_equal_resident(references, device):
    """--mlp-slicing auto: the rates come from the solver, measured on this machine, within a weight
    budget that holds the attention weights and embeddings but not every MLP; tokens unchanged."""
    budget_gib = 0.3  # the embedded model in float32: 0.21 GiB beside the MLPs, which take 0.3 GiB
    with LLM(**EMBEDDED, device=device, cpu_attention="off", mlp_slicing="auto", weights_gpu_gib=budget_gib) as llm:
        outputs, _ = generate(llm, *workload(EMBEDDED, "off"))
        plan = llm.engine.plan.layers.slicing
        assert plan is not None and plan.gpu_weight_bytes <= budget_gib * 2**30
        assert any(rates.gg < 1.0 for rates in plan.rates)
        store = llm.engine.runner.model.layer_store  # the layers were cut at the solved rates
        num_units = llm.engine.model_config.intermediate_size
        sliced = {i for i, rates in enumerate(plan.rates) if rates.gg < 1.0}
        assert set(store.mlps) == sliced
        for index in sliced:
            assert tuple(store.mlps[index].counts.values()) == plan.rates[index].counts(num_units, DENSE_SLICE_UNITS)
    assert outputs == references(EMBEDDED, "off")


@pytest.mark.parametrize("device", [on_testbed("testbed")])  # device cpu: tests/server/test_streaming_server.py
def test_solved_slicing_beside_layers_streamed_whole_equals_resident(references, device):
    """--mlp-slicing auto with a weight budget too small for every layer's attention weights: one
    planner call streams some layers whole and slices the rest, within the budget; tokens unchanged."""
    budget_gib = 0.2  # the embedded model in float32: 0.21 GiB of attention weights, embeddings and head
    with LLM(**EMBEDDED, device=device, cpu_attention="off", mlp_slicing="auto", weights_gpu_gib=budget_gib,
             weights_cpu_gib=0.1) as llm:
        outputs, _ = generate(llm, *workload(EMBEDDED, "off"))
        plan = llm.engine.plan.layers
        assert plan.streamed_layers and plan.sliced_layers
        assert plan.gpu_weight_bytes <= budget_gib * 2**30
        store = llm.engine.runner.model.layer_store
        assert set(store.mlps) == set(plan.sliced_layers) and set(store.ring.items) >= set(plan.streamed_layers)
        stats = llm.engine.weight_stats
        assert stats.bytes_by_tier[TIER_HOST] > 0 and stats.cc_s > 0
        assert llm.engine.runner.model.gpu_weight_bytes() <= budget_gib * 2**30
    assert outputs == references(EMBEDDED, "off")

