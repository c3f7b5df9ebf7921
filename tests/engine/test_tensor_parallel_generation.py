"""Greedy tokens at --tensor-parallel-size 2 equal one rank's, end to end through the engine: two
Ray actors over gloo, each rank one core (the testbed on each where the device is the testbed),
for the embedded model (INT4 as the GGUF stores it, and dense) and a tiny Qwen2 with Q/K/V biases
(dense and INT4 quantized at load), with Neo's offloading off and on (a small GPU pool: swaps,
prefills into the host pool, CPU decodes in both sub-batches, on every rank from the one plan);
each rank's layers streamed or its MLPs sliced by the plan; a MoE model's experts split by their
units, resident or under each rank's hot-expert cache."""
import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.weights import EMBEDDED_MODEL, create_loader
from engine.weights.base import embedded_gguf_path
from offload_costs import write_cost_tables
from tiny_qwen2 import save_tiny_qwen2
from scheduler.planning.tiers import Tier
from test_offload_generation import ALL_PATHS, MAX_TOKENS, PROMPTS, SMALL_POOLS, TWO_CORES, generate_recording_paths

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.tp

NUM_TINY_PROMPTS = 4


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local cluster for the module (each LLM starts only its actors; a CPU each, four ranks at
    most: two pipeline stages of two tensor-parallel ranks)."""
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def greedy(max_tokens):
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]


def run(prompts, params, check=lambda engine: None, **kwargs):
    """Greedy token ids per prompt; `check` sees the engine afterwards (the plan every rank placed
    its layers by, what rank 0's store reported)."""
    with LLM(dtype="float32", **kwargs) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        check(llm.engine)
        return outputs


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A random Qwen2 (biased Q/K/V, GQA 4, untied head) whose widths split on INT4 groups."""
    path = save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), vocab_size=512, hidden_size=256, intermediate_size=320,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=256, tie_word_embeddings=False)
    gguf = embedded_gguf_path()  # any tokenizer will do: the prompts are token ids below 512
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_embedded_model_at_two_ranks_equals_one(quantization):
    params = greedy(MAX_TOKENS[:4])
    one = run(PROMPTS[:4], params, quantization=quantization, cpu_attention="off")
    assert run(PROMPTS[:4], params, quantization=quantization, cpu_attention="off", tensor_parallel_size=2) == one


def test_drafts_verify_on_every_rank():
    """Speculative decoding at two ranks: the wired plan carries the drafts, rank 0's rows come back
    for verification, and the tokens are one rank's without drafts."""
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1,"]
    params = greedy([32, 32])
    one = run(prompts, params, cpu_attention="off")
    accepted = []
    assert run(prompts, params, cpu_attention="off", tensor_parallel_size=2,
               speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}',
               check=lambda engine: accepted.append(engine.speculator.totals.num_accepted_tokens)) == one
    assert accepted[0] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("testbed", marks=pytest.mark.skipif(
    not TWO_CORES, reason="one core per rank needs 2 cores"))])
def test_offloading_on_every_rank_equals_one_rank_without(device, tmp_path):
    quantization = "none" if device == "testbed" else "auto"  # the testbed runs dense weights
    reference = run(PROMPTS, greedy(MAX_TOKENS), quantization=quantization, cpu_attention="off")
    tables = write_cost_tables(tmp_path, create_loader(EMBEDDED_MODEL).config.num_layers)
    with LLM(dtype="float32", quantization=quantization, cpu_attention="on", device=device, cost_tables=tables,
             tensor_parallel_size=2, **SMALL_POOLS) as llm:
        outputs, seen = generate_recording_paths(llm, PROMPTS, greedy(MAX_TOKENS))
    assert seen == ALL_PATHS
    assert outputs == reference


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_tiny_qwen2_with_biases_at_two_ranks_equals_one(tiny_qwen2, quantization, tmp_path):
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 17, 9, 30)]
    params = greedy([12] * NUM_TINY_PROMPTS)
    one = run(prompts, params, model=tiny_qwen2, quantization=quantization, cpu_attention="off")
    tables = write_cost_tables(tmp_path, 2)
    two = run(prompts, params, model=tiny_qwen2, quantization=quantization, cpu_attention="on", cost_tables=tables,
              tensor_parallel_size=2, num_blocks=12, num_cpu_blocks=64, block_size=4, max_num_seqs=4)
    assert two == one


def streams_layers(engine):
    """Some layers stream, and rank 0's ring reported its loads to the driver (as /metrics reads them)."""
    assert 0 < engine.plan.layers.num_layers_in(Tier.HOST) < len(engine.plan.layers.layers)
    assert engine.weight_stats.bytes_by_tier[Tier.HOST] > 0


def slices_mlps(engine):
    assert engine.plan.layers.rates is not None and all(rates.cc == 0.25 for rates in engine.plan.layers.rates)
    assert engine.weight_stats.num_cc_calls > 0


@pytest.mark.parametrize("placement, check", [
    pytest.param(dict(weights_gpu_gib=0.25), streams_layers, id="streamed-from-host"),
    pytest.param(dict(mlp_slicing="0.25,0.5"), slices_mlps, id="sliced"),
])
def test_each_rank_places_its_shard_by_the_plan(placement, check):
    """Weight streaming (PIPO) and MLP slicing (ScheInfer) on every rank, over its shard's layers."""
    params = greedy(MAX_TOKENS[:3])
    one = run(PROMPTS[:3], params, quantization="none", cpu_attention="off")
    assert run(PROMPTS[:3], params, check, quantization="none", cpu_attention="off", tensor_parallel_size=2,
               **placement) == one


def holds_two_hot_experts(engine):
    assert engine.plan.layers.experts is not None and engine.plan.layers.experts.num_slots == 2
    stats = engine.weight_stats
    assert stats.num_hit_pairs + stats.num_miss_pairs > 0


@pytest.mark.parametrize("experts, check", [pytest.param({}, lambda engine: None, id="resident"),
                                            pytest.param(dict(hot_experts="2"), holds_two_hot_experts, id="hot")])
def test_moe_experts_split_by_their_units(experts, check):
    """A Qwen3-MoE (per-head Q/K norms, top-2 of 8 experts) with every expert's units split over
    the ranks, resident or under each rank's hot-expert cache."""
    model = dict(model="qwen3-moe-tiny", load_format="dummy", quantization="none", cpu_attention="off")
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 512, (n,), generator=generator).tolist() for n in (6, 19, 11)]
    params = greedy([16] * 3)
    assert run(prompts, params, check, tensor_parallel_size=2, **model, **experts) == run(prompts, params, **model)
