"""Mixture-of-experts shapes in the planners' arithmetic (no torch): every expert stored, only
the routed ones computed, and the memory model's layer image holding each expert's weights."""
from engine.model_config import ModelConfig
from scheduler.planning import WeightFormat, layer_image_bytes
from scheduler.planning.memory import activation_peak_bytes, linear_shapes

BF16 = WeightFormat("none", 2)


def test_mixtral_8x7b_stores_8_experts_and_computes_2():
    shape = ModelConfig.from_preset("mixtral-8x7b").shape
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    expert = 3 * 4096 * 14336
    assert shape.layer_params == attention + 8 * 4096 + 8 * expert
    assert shape.active_layer_params == attention + 8 * 4096 + 2 * expert
    # the published total: 46.7B parameters, 12.9B active
    embeddings = 2 * 32000 * 4096
    assert round((32 * shape.layer_params + embeddings) / 1e9, 1) == 46.7
    assert round((32 * shape.active_layer_params + embeddings) / 1e9, 1) == 12.9


def test_qwen3_30b_a3b_totals():
    shape = ModelConfig.from_preset("qwen3-30b-a3b").shape
    embeddings = 2 * 151936 * 2048
    # the published total: 30.5B parameters, 3.3B active
    assert abs((48 * shape.layer_params + embeddings) / 1e9 - 30.5) < 0.1
    assert abs((48 * shape.active_layer_params + embeddings) / 1e9 - 3.3) < 0.1


def test_dense_shape_is_unchanged():
    shape = ModelConfig.from_preset("llama-3.1-8b").shape
    assert not shape.is_moe and shape.layer_params == shape.active_layer_params
    assert set(linear_shapes(shape)) == {"qkv", "o_proj", "gate_up", "down"}


def test_layer_image_holds_every_expert_and_keeps_the_router_dense():
    shape = ModelConfig.from_preset("qwen3-moe-1b-a400m").shape
    shapes = linear_shapes(shape)
    assert shapes["router"] == (32, 1024)
    assert [name for name in shapes if name.endswith("gate_up")] == [f"experts.{e}.gate_up" for e in range(32)]
    assert all(shapes[f"experts.{e}.down"] == (1024, 512) for e in range(32))
    dense_bytes = layer_image_bytes(shape, BF16)
    assert dense_bytes >= 2 * shape.layer_params
    assert dense_bytes - 2 * shape.layer_params < 4096 + 256 * len(shapes)  # alignment only
    int4 = layer_image_bytes(shape, WeightFormat("int4", 2))
    # 4-bit codes and an fp32 scale and min per 32 weights: 0.75 bytes a weight against 2
    assert 0.37 * dense_bytes < int4 < 0.38 * dense_bytes


def test_moe_activations_follow_the_expert_width():
    moe = ModelConfig.from_preset("qwen3-30b-a3b").shape
    num_tokens = 512
    # hidden, normed, gathered rows, the sum (2048 each), one expert's gate/up and product (3 x 768),
    # and the fp32 router probabilities over 128 experts
    expected_mlp = num_tokens * (4 * 2048 + 3 * 768) * 2 + num_tokens * 128 * 4
    attention = num_tokens * (2 * 2048 + 2 * 4096 + 2 * 512) * 2
    assert activation_peak_bytes(moe, BF16, num_tokens, 1) == max(expected_mlp, attention,
                                                                  2048 * 2 + 151936 * (2 + 4))
