"""CUDA graphs of the decode step (engine/runtime/cuda_graphs.py): the buckets and the padding
here; on a GPU (`make test-gpu`), greedy tokens of graphed decode steps against eager ones while
batches shrink through the buckets, dense and INT4."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.attention import AttentionMetadata
from engine.runtime.cuda_graphs import DecodeGraphs, DecodeRows, StaticDecodeInputs, batch_buckets, bucket_for
from engine.offload.layer_store import PlannedLayers
from engine.model.layer_store import LayerStore
from engine.model.moe import MoeModel
from engine.weights import EMBEDDED_MODEL, create_loader


def test_buckets_reach_the_largest_batch_and_no_further():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 4)
    assert batch_buckets(9) == (1, 2, 4, 8, 16)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(10_000)[-1] == 256


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    buckets = batch_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 63, 64, 65)] == [1, 2, 4, 8, 8, 16, 64, 64, None]


def test_padding_repeats_the_last_row():
    rows = DecodeRows([5, 7], [10, 3], [[1, 2], [4]]).padded(4)
    assert rows.token_ids == [5, 7, 7, 7]
    assert rows.positions == [10, 3, 3, 3]
    assert rows.block_tables == [[1, 2], [4], [4], [4]]


@pytest.fixture(scope="module")
def cpu_llm():
    """The torch ops a CUDA forward runs, on the CPU."""
    with LLM(model=EMBEDDED_MODEL, load_format="dummy", dtype="float32", device="cpu", cpu_attention="off",
             cpu_ops="torch", decode_attention="torch", num_blocks=8, max_model_len=64) as llm:
        yield llm


def test_the_static_inputs_give_the_eager_logits_and_padded_rows_copy_the_last(cpu_llm, gen):
    """What a graph records, run here on the CPU: the forward over the static buffers' int32
    views, padded to a bucket, against the eager forward over the same rows."""
    rows = DecodeRows([11, 22, 33], [20, 5, 17], [[1, 2], [3], [4, 5]])
    model, kv_cache = cpu_llm.engine.runner.model, cpu_llm.engine.runner.kv_cache
    kv_cache.gpu.key.copy_(torch.randn(kv_cache.gpu.key.shape, generator=gen))
    kv_cache.gpu.value.copy_(torch.randn(kv_cache.gpu.value.shape, generator=gen))
    meta = AttentionMetadata([], 0, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                             decode_block_tables=torch.tensor([[1, 2], [3, 0], [4, 5]], dtype=torch.int32),
                             decode_context_lens=torch.tensor([21, 6, 18], dtype=torch.int32))
    with torch.inference_mode():
        eager = model.forward(torch.tensor(rows.token_ids), torch.tensor(rows.positions), kv_cache, meta,
                              torch.arange(3))
        inputs = StaticDecodeInputs(max_rows=8, max_blocks=4, device=torch.device("cpu"))
        inputs.stage(rows.padded(4))
        static = inputs.forward_of(model, kv_cache, 4)()
    torch.testing.assert_close(static[:3], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static[3], static[2], rtol=1e-5, atol=1e-5)


def test_only_resident_dense_models_on_cuda_are_captured(cpu_llm):
    assert LayerStore(torch.device("cpu")).graph_capturable
    assert not PlannedLayers.weights_stay_put  # so not graph_capturable: streamed layers copy mid-forward
    assert not MoeModel.graph_capturable
    assert DecodeGraphs.applies_to(cpu_llm.engine.runner.model) == "its device is cpu"
    assert cpu_llm.engine.runner.graphs is None


def test_enforce_eager_must_be_a_bool():
    with pytest.raises(ConfigError, match="enforce_eager must be true or false"):
        EngineConfig(enforce_eager="yes")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("bfloat16", "int4")])
def test_graphed_decode_gives_the_eager_greedy_tokens(dtype, quantization):
    """Requests of different lengths finish at different steps, so the batch passes through
    buckets 8, 4, 2 and 1 with padded rows; every token must be the eager run's."""
    config = create_loader(EMBEDDED_MODEL, "dummy").config
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 6, 12, 7, 30)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7, 12, 16, 24)]
    model = dict(model=EMBEDDED_MODEL, load_format="dummy", dtype=dtype, quantization=quantization, device="cuda",
                 cpu_attention="off")
    with LLM(enforce_eager=True, **model) as llm:
        assert llm.engine.runner.graphs is None
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(**model) as llm:
        graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.enabled and graphs.num_replays > 0
        assert sorted(graphs.captured_buckets) == [1, 2, 4, 8]
    assert graphed == eager
