"""Greedy tokens at --pipeline-parallel-size 2 and 3 equal one process's, end to end through the
engine: each stage a Ray actor holding its own run of decoder layers and its own KV pools for them,
a step's hidden states handed from stage to stage; the embedded model packed INT4 (as the GGUF
stores it) and dense, chunked prefills and prefix hits, and speculative verify rows, which pass
through the stages like any decode row."""
import pytest

from scheduler.planning.tiers import Tier

from engine import LLM
from test_offload_generation import MAX_TOKENS, PROMPTS
from test_tensor_parallel_generation import greedy, ray_cluster  # noqa: F401 (the module's cluster)

pytestmark = pytest.mark.tp
SHARED_PREFIX = "You are a helpful assistant. Answer briefly and clearly, in one or two sentences. " * 3


def run(prompts, params, rounds=1, check=lambda engine: None, **kwargs):
    """Greedy token ids per prompt, `rounds` times over (a later round's prompts hit the cache);
    `check` sees the engine afterwards."""
    with LLM(dtype="float32", **kwargs) as llm:
        outputs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(rounds)]
        check(llm.engine)
        return outputs


def hit_and_drafted(engine) -> None:
    assert engine.scheduler.prefix_cache.counters.hits["gpu"] > 0
    assert engine.speculator.totals.num_accepted_tokens > 0


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_two_stages_give_one_process_tokens(quantization):
    params = greedy(MAX_TOKENS[:4])
    expected = run(PROMPTS[:4], params, quantization=quantization)[0]
    assert run(PROMPTS[:4], params, quantization=quantization, pipeline_parallel_size=2)[0] == expected


def test_three_stages_chunked_with_prefix_hits_and_drafts():
    """30 layers over 3 stages; 8-token chunks; the second round's prompts hit the cache; n-gram
    drafts verified wherever the lookup has some."""
    prompts = [SHARED_PREFIX + prompt for prompt in PROMPTS[:3]]  # whole blocks to cache
    params = greedy(MAX_TOKENS[:3])
    drafts = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'
    expected = run(prompts, params)[0]
    assert run(prompts, params, rounds=2, max_num_batched_tokens=8, max_num_seqs=4, pipeline_parallel_size=3,
               speculative_config=drafts, check=hit_and_drafted) == [expected, expected]


def test_two_stages_of_two_tensor_parallel_ranks_give_one_process_tokens():
    """-pp 2 -tp 2: each stage's two ranks all-reduce in a group of their own; both read the first
    stage's output, and the last stage's rank 0 samples from the gathered head."""
    params = greedy(MAX_TOKENS[:3])
    expected = run(PROMPTS[:3], params)[0]
    assert run(PROMPTS[:3], params, pipeline_parallel_size=2, tensor_parallel_size=2)[0] == expected


def each_stage_streams(engine):
    """Every stage planned its own layers under the per-node budget, and streams some."""
    plans = engine.plan.stage_layers
    assert len(plans) == engine.config.parallel.pipeline_parallel_size
    assert all(0 < plan.num_layers_in(Tier.HOST) < len(plan.layers) for plan in plans)
    assert engine.weight_stats.bytes_by_tier[Tier.HOST] > 0  # the sampling stage's ring loaded


@pytest.mark.parametrize("num_stages, budget_gib", [(2, 0.2), (4, 0.17)])
def test_each_stage_streams_its_own_layers(num_stages, budget_gib):
    """Weight streaming (PIPO) inside each stage, the budget a node's: 2 stages of 15 layers, and 4
    of 8, 8, 7 and 7 (two plans)."""
    params = greedy(MAX_TOKENS[:3])
    one = run(PROMPTS[:3], params, quantization="none", cpu_attention="off")[0]
    assert run(PROMPTS[:3], params, check=each_stage_streams, quantization="none", cpu_attention="off",
               weights_gpu_gib=budget_gib, pipeline_parallel_size=num_stages)[0] == one


def test_each_stage_slices_its_own_mlps():
    """MLP slicing (ScheInfer) at fixed rates inside each stage."""
    def sliced(engine):
        assert all(plan.rates is not None for plan in engine.plan.stage_layers)
        assert engine.weight_stats.num_cc_calls > 0

    params = greedy(MAX_TOKENS[:3])
    one = run(PROMPTS[:3], params, quantization="none", cpu_attention="off")[0]
    assert run(PROMPTS[:3], params, check=sliced, quantization="none", cpu_attention="off", mlp_slicing="0.25,0.5",
               pipeline_parallel_size=2)[0] == one
