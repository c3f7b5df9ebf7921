"""Tiny random mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against Hugging Face
transformers built from the same config and weights: logits through the engine's paged KV cache,
greedy tokens against `generate`, weight accounting, and the C++ decoder declining MoE layers."""
import pytest
import torch

from engine.attention import create_decode_backend
from engine.runtime import ModelRunner
from engine.model import MoeModel, create_model
from engine.model.moe import SparseMoe, SwiGluMlp
from engine.quant import create_linear_method
from engine.weights import create_loader
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence
from tiny_moe import (BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, VOCAB_SIZE, build_tiny_moe, check_logits_against_hf,
                      family_cases)

NEW_TOKENS = 10
# 4-bit weights with a scale and min per 32 of random Gaussian weights: steps of about 0.27 sigma, so
# about 8% error a matrix and 12% through a SwiGLU MLP (measured); a wrong expert or order gives ~100%
INT4_RELATIVE_ERROR = 0.25


@pytest.fixture(scope="module", params=sorted(family_cases()))
def tiny_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return build_tiny_moe(request.param, path), str(path)


def make_runner(path: str, backend: str = "torch") -> ModelRunner:
    loader = create_loader(path)
    return ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=NUM_BLOCKS,
                       block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, decode_backend=backend)


def make_scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN))


def random_prompt(gen: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (length,), generator=gen).tolist()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefill_and_paged_decode_logits_match_hf(tiny_moe, backend):
    """Prefills of mixed lengths packed in one batch (one an exact block multiple), then decodes
    from the paged cache with a late prefill joining: every sequence's logits equal HF's."""
    hf_model, path = tiny_moe
    runner = make_runner(path, backend)
    assert isinstance(runner.model, MoeModel)
    check_logits_against_hf(runner, hf_model, prompt_lengths=[7, 1, 16, 13], num_steps=6, seed=1,
                            late_prompt_length=9)


@torch.no_grad()
def test_greedy_tokens_match_hf_generate(tiny_moe):
    """Batched greedy decoding through the scheduler, the runner and the sampler gives HF's tokens."""
    hf_model, path = tiny_moe
    runner, sched = make_runner(path, "cpu"), make_scheduler()
    gen = torch.Generator().manual_seed(2)
    prompts = [random_prompt(gen, length) for length in (5, 12, 3)]
    sequences = [Sequence(str(i), p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
                 for i, p in enumerate(prompts)]
    for seq in sequences:
        sched.add_sequence(seq)
    while sched.has_unfinished_sequences():
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan).sampled.token_ids)
    for seq, prompt in zip(sequences, prompts):
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=NEW_TOKENS)
        assert seq.output_token_ids == out[0, len(prompt):].tolist()


def test_tokens_are_grouped_by_expert_and_several_experts_run(tiny_moe):
    """The routing the parity tests cover is not degenerate: a prefill spreads its tokens over
    several experts of every MoE layer."""
    _, path = tiny_moe
    loader = create_loader(path)
    model = create_model(loader.config, loader, torch.float32, "cpu", MAX_MODEL_LEN, create_decode_backend("torch"))
    moe_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe)]
    assert moe_layers
    x = torch.randn(24, loader.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for moe in moe_layers:
        routing = moe.router.route(x)
        assert len(set(routing.expert_ids.flatten().tolist())) > 1


def test_weight_bytes_count_every_parameter_once(tiny_moe):
    """Every expert's, router's and norm's bytes as the weight objects report them: the same total
    as the HF model's parameters."""
    hf_model, path = tiny_moe
    loader = create_loader(path)
    model = create_model(loader.config, loader, torch.float32, "cpu", 64, create_decode_backend("torch"))
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert model.weight_bytes() == {("float32", "gpu"): 4 * num_params}


def test_layers_keep_the_families_mlp_kinds(tiny_moe):
    """MoE layers route; the layers a Qwen config keeps dense (`mlp_only_layers`) have the plain MLP."""
    _, path = tiny_moe
    loader = create_loader(path)
    model = create_model(loader.config, loader, torch.float32, "cpu", 64, create_decode_backend("torch"))
    moe = loader.config.moe
    for index, layer in enumerate(model.layers):
        if moe.is_moe_layer(index):
            assert isinstance(layer.mlp, SparseMoe) and len(layer.mlp.experts) == moe.num_experts
            assert (layer.mlp.shared is not None) == moe.has_shared_expert
        else:
            assert isinstance(layer.mlp, SwiGluMlp)


def test_cpu_decoder_declines_moe_and_the_model_runs_op_by_op(tiny_moe, caplog):
    _, path = tiny_moe
    loader = create_loader(path)
    with caplog.at_level("INFO", logger="engine.model.llama"):
        model = create_model(loader.config, loader, torch.float32, "cpu", 64, create_decode_backend("cpu"),
                             cpu_ops="layers")
    assert model.native is None
    assert "run op by op" in caplog.text and "routed experts" in caplog.text


def test_weight_streaming_refuses_moe_layers_with_a_reason():
    from engine import LLM
    from engine.model_config import ConfigError
    with pytest.raises(ConfigError, match="weight streaming does not take mixture-of-experts layers; .*--mlp-slicing auto"):
        LLM("qwen3-moe-tiny", load_format="dummy", dtype="float32", weight_placement="cpu")


@torch.no_grad()
def test_int4_experts_are_weight_objects_of_their_own(tiny_moe):
    """The INT4 method makes every expert's gate/up and down an INT4 weight (the router stays dense),
    and the quantized model's logits stay close to the dense one's."""
    from engine.quant.int4 import Int4Weight
    _, path = tiny_moe
    loader = create_loader(path)
    config = loader.config
    if config.moe.expert_intermediate_size % 32:  # INT4 groups of 32 along each input
        pytest.skip("expert width not a multiple of the INT4 group")
    int4 = create_model(config, loader, torch.float32, "cpu", MAX_MODEL_LEN, create_decode_backend("torch"),
                        linear_method=create_linear_method("int4"))
    dense = create_model(config, loader, torch.float32, "cpu", MAX_MODEL_LEN, create_decode_backend("torch"))
    for layer in int4.layers:
        if isinstance(layer.mlp, SparseMoe):
            assert all(isinstance(w, Int4Weight) for e in layer.mlp.experts for w in e.linear_weights())
            assert not isinstance(layer.mlp.router.gate, Int4Weight)
    hidden = torch.randn(16, config.hidden_size, generator=torch.Generator().manual_seed(5))
    for index, (quantized, full) in enumerate(zip(int4.layers, dense.layers)):
        x = dense.rms_norm(hidden, full.post_norm, config.rms_norm_eps)
        expected = dense._mlp(index, x)
        error = (int4._mlp(index, x) - expected).norm() / expected.norm()
        assert error < INT4_RELATIVE_ERROR, (index, error)


def test_layer_files_refuse_moe_layers(tmp_path):
    from engine.model_config import ConfigError
    from engine.offload.convert import convert
    from engine.weights.layer_files import ConversionKey, LayerFiles
    loader = create_loader("qwen3-moe-tiny", load_format="dummy")
    files = LayerFiles(str(tmp_path), ConversionKey(loader.source, 0, "float32", "none", "cpu"), loader.config.num_layers)
    with pytest.raises(ConfigError, match="mixture-of-experts layers are served resident"):
        convert(loader, files, create_linear_method("dense"), torch.float32, torch.device("cpu"))
