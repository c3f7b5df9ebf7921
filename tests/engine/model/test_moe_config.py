"""Mixture-of-experts configs: the presets' published shapes, each family's HF and GGUF fields,
bad values named, and the dummy loader's expert weights."""
import pytest
import torch

from engine.model_config import ConfigError, ModelConfig
from engine.moe_config import MoeConfig, MoeConfigError
from engine.weights import create_loader, expert_prefix, layer_shapes

# name -> (layers, hidden, heads, kv heads, head_dim, vocab, experts, top-k, expert width, renormalized, qk norm)
MOE_PRESETS = {
    "mixtral-8x7b": (32, 4096, 32, 8, 128, 32000, 8, 2, 14336, True, False),
    "qwen3-30b-a3b": (48, 2048, 32, 4, 128, 151936, 128, 8, 768, True, True),
    "qwen3-moe-1b-a400m": (24, 1024, 16, 8, 64, 49155, 32, 8, 512, True, True),
    "qwen3-moe-tiny": (2, 128, 4, 2, 32, 512, 8, 2, 64, True, True),
}


@pytest.mark.parametrize("name", sorted(MOE_PRESETS))
def test_moe_presets_parse(name):
    c = ModelConfig.from_preset(name)
    m = c.moe
    got = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, m.num_experts,
           m.num_experts_per_token, m.expert_intermediate_size, m.normalize_top_k, c.qk_norm)
    assert got == MOE_PRESETS[name]
    assert m.dense_layers == () and not m.has_shared_expert and not c.attention_bias


def test_mixtral_8x7b_layer_holds_every_expert():
    config = ModelConfig.from_preset("mixtral-8x7b")
    shapes = layer_shapes(config, 5)
    assert shapes["router"] == (8, 4096)
    for e in range(8):
        assert shapes[f"{expert_prefix(e)}gate_proj"] == shapes[f"{expert_prefix(e)}up_proj"] == (14336, 4096)
        assert shapes[f"{expert_prefix(e)}down_proj"] == (4096, 14336)
    assert "gate_proj" not in shapes and "q_norm" not in shapes


def qwen_moe_dict(**fields):
    d = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
             num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16)
    return {**d, **fields}


def test_qwen_dense_layers_from_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_hf_dict(qwen_moe_dict(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.moe.dense_layers == (0, 2, 3, 4)  # (i + 1) % 2 != 0, and 3 listed
    shapes = layer_shapes(config, 0)
    assert shapes["gate_proj"] == (48, 32) and "router" not in shapes
    assert layer_shapes(config, 1)["router"] == (4, 32) and layer_shapes(config, 1)["q_norm"] == (8,)


def test_qwen2_moe_has_a_gated_shared_expert_and_qkv_bias():
    config = ModelConfig.from_hf_dict(qwen_moe_dict(architectures=["Qwen2MoeForCausalLM"],
                                                    shared_expert_intermediate_size=40))
    assert config.moe.has_shared_expert and config.moe.shared_expert_gated and config.attention_bias
    assert not config.qk_norm
    shapes = layer_shapes(config, 0)
    assert shapes["shared_expert.down_proj"] == (32, 40) and shapes["shared_expert_gate"] == (1, 32)


@pytest.mark.parametrize("fields,message", [
    (dict(num_experts_per_tok=5), "num_experts_per_token (5) exceeds num_experts (4)"),
    (dict(num_experts=0, num_experts_per_tok=0), "num_experts must be positive"),
    (dict(moe_intermediate_size=0), "expert_intermediate_size must be positive"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be positive"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_bad_moe_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_dict(qwen_moe_dict(**fields))


def test_moe_config_checks_its_own_fields():
    with pytest.raises(MoeConfigError, match="shared_expert_intermediate_size"):
        MoeConfig(num_experts=4, num_experts_per_token=2, expert_intermediate_size=8, normalize_top_k=True,
                  shared_expert_intermediate_size=-1)


def gguf_metadata(arch: str, **fields):
    meta = {"general.architecture": arch, f"{arch}.attention.head_count": 4, f"{arch}.embedding_length": 32,
            f"{arch}.block_count": 2, f"{arch}.vocab_size": 64, f"{arch}.feed_forward_length": 48}
    return {**meta, **{f"{arch}.{key}": value for key, value in fields.items()}}


def test_gguf_llama_with_experts_is_mixtral():
    config = ModelConfig.from_gguf_metadata(gguf_metadata("llama", expert_count=8, expert_used_count=2))
    assert config.architecture == "mixtral"
    assert config.moe == MoeConfig(num_experts=8, num_experts_per_token=2, expert_intermediate_size=48,
                                   normalize_top_k=True)
    assert ModelConfig.from_gguf_metadata(gguf_metadata("llama")).moe is None


def test_gguf_qwen_moe_fields():
    qwen3 = ModelConfig.from_gguf_metadata(gguf_metadata("qwen3moe", expert_count=4, expert_used_count=2,
                                                         expert_feed_forward_length=16))
    assert qwen3.architecture == "qwen3_moe" and qwen3.qk_norm and qwen3.moe.normalize_top_k
    assert qwen3.moe.expert_intermediate_size == 16
    raw = ModelConfig.from_gguf_metadata(gguf_metadata("qwen3moe", expert_count=4, expert_used_count=2,
                                                       expert_weights_norm=False))
    assert not raw.moe.normalize_top_k
    qwen2 = ModelConfig.from_gguf_metadata(gguf_metadata("qwen2moe", expert_count=4, expert_used_count=2,
                                                         expert_shared_feed_forward_length=24))
    assert qwen2.architecture == "qwen2_moe" and not qwen2.moe.normalize_top_k and qwen2.attention_bias
    assert qwen2.moe.shared_expert_intermediate_size == 24 and qwen2.moe.shared_expert_gated


def test_gguf_moe_without_used_count_is_a_config_error():
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        ModelConfig.from_gguf_metadata(gguf_metadata("qwen3moe", expert_count=4))


def test_dummy_moe_weights_every_expert(tmp_path):
    loader = create_loader("qwen3-moe-tiny", load_format="dummy", seed=3)
    layer = loader.load_layer(1, torch.float32)
    shapes = layer_shapes(loader.config, 1)
    assert set(layer) == set(shapes)
    assert all(tuple(layer[key].shape) == shape for key, shape in shapes.items())
    assert torch.equal(layer["q_norm"], torch.ones(32))
    gates = [layer[f"{expert_prefix(e)}gate_proj"] for e in range(8)]
    assert all(not torch.equal(gates[0], other) for other in gates[1:])  # every expert its own weights
    assert 0.015 < layer["router"].std().item() < 0.025

