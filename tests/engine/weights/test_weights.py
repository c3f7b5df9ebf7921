"""Weight loaders: each compared with what Hugging Face transformers loads, or with the
weights a tiny checkpoint was written from; and every bad checkpoint named in its error."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from engine.model_config import PRESET_DIR, ConfigError, ModelConfig, list_presets
from engine.weights import (
    EMBEDDED_MODEL,
    WeightLoadError,
    create_loader,
    embedded_gguf_path,
    global_shapes,
    layer_shapes,
)
from engine.weights.dummy import DummyLoader
from engine.weights.gguf_loader import SUPPORTED_TYPES, GGUFLoader
from engine.weights.safetensors_loader import SafetensorsLoader
from tiny_gguf import write_tiny_gguf

# transformers is imported inside fixtures, after this: never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HF_LAYER_NAMES = {
    "input_layernorm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
}
HF_GLOBAL_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
TINY_SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def assert_matches_hf(loaded: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor], index: int | None) -> None:
    for key, tensor in loaded.items():
        name = HF_GLOBAL_NAMES[key] if index is None else f"model.layers.{index}.{HF_LAYER_NAMES[key]}"
        torch.testing.assert_close(tensor, state_dict[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------- the embedded GGUF model


@pytest.fixture(scope="module")
def embedded_loader():
    return create_loader(EMBEDDED_MODEL)


# `embedded_hf_model`: tests/engine/conftest.py


def test_embedded_gguf_matches_transformers(embedded_loader, embedded_hf_model):
    state_dict = embedded_hf_model.state_dict()
    loaded = embedded_loader.load_globals(torch.float32)
    assert set(loaded) == {"embed_tokens", "norm"}  # tied embeddings: no lm_head
    assert_matches_hf(loaded, state_dict, None)
    last = embedded_loader.config.num_layers - 1
    for index in (0, 1, last):
        layer = embedded_loader.load_layer(index, torch.float32)
        assert set(layer) == set(layer_shapes(embedded_loader.config))
        assert_matches_hf(layer, state_dict, index)


def test_embedded_gguf_config(embedded_loader, embedded_hf_model):
    config, hf = embedded_loader.config, embedded_hf_model.config
    assert embedded_loader.source == str(embedded_gguf_path())
    assert embedded_loader.tokenizer_source == str(embedded_gguf_path())
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", hf.num_hidden_layers, hf.hidden_size)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )
    assert (config.vocab_size, config.intermediate_size) == (hf.vocab_size, hf.intermediate_size)
    assert config.tie_word_embeddings and hf.tie_word_embeddings
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    # The preset describes the same model.
    preset = ModelConfig.from_preset(EMBEDDED_MODEL)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "attention_bias"):
        assert getattr(preset, field) == getattr(config, field), field
    assert preset.rms_norm_eps == pytest.approx(config.rms_norm_eps)


def test_load_layer_dtype_and_range(embedded_loader):
    layer = embedded_loader.load_layer(2, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in layer.values())
    with pytest.raises(IndexError, match="layer 30"):
        embedded_loader.load_layer(embedded_loader.config.num_layers, torch.float32)


# ---------------------------------------------------------------- HF safetensors directories


def save_tiny_hf(directory: Path, architecture: str, tie: bool, max_shard_size: str | None = "40KB") -> dict:
    """Save a tiny random HF model (every parameter random, biases included); return its state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        architecture
    ]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY_SHAPE, tie_word_embeddings=tie))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return {name: t.clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("architecture,tie", [("llama", False), ("qwen2", True)])
def test_sharded_safetensors_round_trip(tmp_path, architecture, tie):
    state_dict = save_tiny_hf(tmp_path, architecture, tie)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loader = create_loader(str(tmp_path))
    assert isinstance(loader, SafetensorsLoader)
    assert loader.tokenizer_source == str(tmp_path)
    assert loader.config.tie_word_embeddings == tie
    assert loader.config.attention_bias == (architecture == "qwen2")
    loaded = loader.load_globals(torch.float32)
    assert ("lm_head" in loaded) == (not tie)
    assert_matches_hf(loaded, state_dict, None)
    for index in range(loader.config.num_layers):
        layer = loader.load_layer(index, torch.float32)
        assert set(layer) == set(layer_shapes(loader.config))
        assert_matches_hf(layer, state_dict, index)
    assert loader.load_layer(0, torch.float16)["q_proj"].dtype == torch.float16


@pytest.fixture
def sharded_llama(tmp_path) -> Path:
    save_tiny_hf(tmp_path, "llama", tie=False)
    return tmp_path


def shard_holding(directory: Path, tensor: str) -> Path:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    return directory / weight_map[tensor]


def read_safetensors_header(path: Path) -> dict:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    return header


def test_truncated_shard_names_file_and_tensor(sharded_llama):
    shard = shard_holding(sharded_llama, "model.layers.1.mlp.down_proj.weight")
    header = read_safetensors_header(shard)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    os.truncate(shard, shard.stat().st_size - 10)
    with pytest.raises(WeightLoadError, match="truncated") as error:
        create_loader(str(sharded_llama))
    assert str(shard) in str(error.value) and repr(last) in str(error.value)


def test_missing_shard_names_file_and_tensor(sharded_llama):
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = shard_holding(sharded_llama, name)
    shard.unlink()
    with pytest.raises(WeightLoadError, match="shard file missing") as error:
        create_loader(str(sharded_llama))
    assert str(shard) in str(error.value) and "model.layers.0." in str(error.value)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    save_tiny_hf(tmp_path, "llama", tie=False, max_shard_size=None)
    single = tmp_path / "model.safetensors"
    tensors = load_file(single)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, single)
    with pytest.raises(WeightLoadError, match="'model.layers.1.mlp.up_proj.weight' missing") as error:
        create_loader(str(tmp_path))
    assert str(single) in str(error.value)


def test_untied_config_without_lm_head(tmp_path):
    save_tiny_hf(tmp_path, "qwen2", tie=True, max_shard_size=None)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": False}))
    with pytest.raises(WeightLoadError, match="'lm_head.weight' missing.*tie_word_embeddings"):
        create_loader(str(tmp_path))


def test_shape_mismatch_names_tensor_and_shapes(sharded_llama):
    config_path = sharded_llama / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "intermediate_size": 128}))
    with pytest.raises(WeightLoadError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[96, 64\], expected \[128, 64\]"):
        create_loader(str(sharded_llama))


# ---------------------------------------------------------------- GGUF files written here (tiny_gguf.py)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda qtype: qtype.name)
def test_gguf_types_and_unpermute(tmp_path, qtype):
    path = tmp_path / "tiny.gguf"
    expected, _ = write_tiny_gguf(path, qtype=qtype)
    loader = create_loader(str(path))
    assert isinstance(loader, GGUFLoader)
    assert not loader.config.tie_word_embeddings  # the file has output.weight
    for key, tensor in loader.load_globals(torch.float32).items():
        torch.testing.assert_close(tensor, expected["globals"][key], rtol=0, atol=0, msg=key)
    for index in range(loader.config.num_layers):
        for key, tensor in loader.load_layer(index, torch.float32).items():
            torch.testing.assert_close(tensor, expected[index][key], rtol=0, atol=0, msg=f"{index}.{key}")


def test_gguf_qwen2_not_permuted_with_bias(tmp_path):
    path = tmp_path / "qwen.gguf"
    expected, _ = write_tiny_gguf(path, architecture="qwen2", tie=True)
    loader = create_loader(str(path), load_format="gguf")
    assert loader.config.architecture == "qwen2" and loader.config.tie_word_embeddings
    assert set(loader.load_globals(torch.float32)) == {"embed_tokens", "norm"}
    layer = loader.load_layer(1, torch.float32)
    assert {"q_bias", "k_bias", "v_bias"} <= set(layer)
    for key, tensor in layer.items():
        torch.testing.assert_close(tensor, expected[1][key], rtol=0, atol=0, msg=key)


def test_truncated_gguf_names_file_and_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    _, last_name = write_tiny_gguf(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(WeightLoadError, match="truncated") as error:
        create_loader(str(path))
    assert str(path) in str(error.value) and repr(last_name) in str(error.value)


def test_gguf_cut_in_header(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    os.truncate(path, 200)
    with pytest.raises(WeightLoadError, match="not a readable GGUF") as error:
        create_loader(str(path))
    assert str(path) in str(error.value)


def test_gguf_unsupported_type_names_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types={"blk.1.attn_q.weight": QType.IQ4_NL})
    with pytest.raises(WeightLoadError, match="'blk.1.attn_q.weight' has type IQ4_NL") as error:
        create_loader(str(path))
    assert str(path) in str(error.value)


def test_gguf_missing_tensor(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, skip=("blk.0.ffn_up.weight",))
    with pytest.raises(WeightLoadError, match="'blk.0.ffn_up.weight' missing") as error:
        create_loader(str(path))
    assert str(path) in str(error.value)


# ---------------------------------------------------------------- dummy weights and presets


def test_dummy_reproducible_per_layer():
    first = create_loader("qwen2-0.5b", load_format="dummy", seed=7)
    again = create_loader("qwen2-0.5b", load_format="dummy", seed=7)
    other = create_loader("qwen2-0.5b", load_format="dummy", seed=8)
    layer = first.load_layer(3, torch.bfloat16)
    assert set(layer) == set(layer_shapes(first.config))
    for key, shape in layer_shapes(first.config).items():
        assert layer[key].shape == shape and layer[key].dtype == torch.bfloat16, key
    reloaded = first.load_layer(3, torch.bfloat16)
    from_again = again.load_layer(3, torch.bfloat16)
    from_other = other.load_layer(3, torch.bfloat16)
    neighbour = first.load_layer(4, torch.bfloat16)
    for key in layer:
        assert torch.equal(layer[key], reloaded[key]) and torch.equal(layer[key], from_again[key]), key
        if not key.endswith("norm"):
            assert not torch.equal(layer[key], from_other[key]), key
            assert not torch.equal(layer[key], neighbour[key]), key
    assert torch.equal(layer["input_layernorm"], torch.ones(first.config.hidden_size, dtype=torch.bfloat16))
    assert 0.015 < layer["gate_proj"].float().std().item() < 0.025  # scaled for a sane forward pass
    assert first.source == "dummy:qwen2-0.5b" and first.tokenizer_source is None


def test_dummy_globals_and_dtypes():
    loader = create_loader("smollm2-135m", load_format="dummy")
    assert isinstance(loader, DummyLoader)
    globals_ = loader.load_globals(torch.float16)
    assert {key: tuple(t.shape) for key, t in globals_.items()} == global_shapes(loader.config)
    assert "lm_head" not in globals_
    layer32 = loader.load_layer(0, torch.float32)
    layer16 = loader.load_layer(0, torch.float16)
    torch.testing.assert_close(layer16["q_proj"].float(), layer32["q_proj"], rtol=1e-3, atol=1e-5)
    # Windows of the random pool: neighbouring rows are shifted, not repeated.
    assert not torch.equal(layer32["down_proj"][0], layer32["down_proj"][1])


# name -> (layers, hidden, intermediate, heads, kv heads, head_dim, vocab, rope_theta, max positions, tied, bias)
PRESET_NUMBERS = {
    "smollm2-135m": (30, 576, 1536, 9, 3, 64, 49152, 1e5, 8192, True, False),
    "llama-2-7b": (32, 4096, 11008, 32, 32, 128, 32000, 1e4, 4096, False, False),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256, 5e5, 131072, False, False),
    "llama-3.1-70b": (80, 8192, 28672, 64, 8, 128, 128256, 5e5, 131072, False, False),
    "qwen2-0.5b": (24, 896, 4864, 14, 2, 64, 151936, 1e6, 131072, True, True),
    "mistral-7b-v0.1": (32, 4096, 14336, 32, 8, 128, 32000, 1e4, 32768, False, False),
}


def test_presets_parse():
    assert set(list_presets()) >= set(PRESET_NUMBERS)
    for name, numbers in PRESET_NUMBERS.items():
        c = ModelConfig.from_preset(name)
        got = (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
               c.vocab_size, c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings, c.attention_bias)
        assert got == numbers, name
    scaling = ModelConfig.from_preset("llama-3.1-8b").rope_scaling
    assert scaling is not None and (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                                    scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
    assert ModelConfig.from_preset("llama-3.1-70b").rope_scaling == scaling
    assert ModelConfig.from_preset("mistral-7b-v0.1").architecture == "mistral"
    assert ModelConfig.from_preset("qwen2-0.5b").architecture == "qwen2"


# ---------------------------------------------------------------- create_loader resolution


def test_create_loader_resolution(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    assert isinstance(create_loader(tmp_path / "tiny.gguf"), GGUFLoader)
    save_tiny_hf(tmp_path / "hf", "llama", tie=False)
    assert isinstance(create_loader(str(tmp_path / "hf"), load_format="safetensors"), SafetensorsLoader)
    assert isinstance(create_loader("llama-3.1-70b", load_format="dummy"), DummyLoader)


def test_embedded_model_resolves_to_packaged_gguf(embedded_loader):
    assert isinstance(embedded_loader, GGUFLoader)
    assert embedded_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "model,load_format,message",
    [
        ("llama-2-7b", "auto", "load_format='dummy'"),
        ("no-such-model", "auto", "not found"),
        ("/nonexistent/model.gguf", "auto", "not found"),
        ("/nonexistent/model.gguf", "gguf", "GGUF file not found"),
        ("/nonexistent/dir", "safetensors", "not a directory"),
        ("no-such-preset", "dummy", "unknown model preset"),  # a ConfigError
        ("smollm2-135m", "pickle", "valid: auto, gguf, safetensors, dummy"),
    ],
)
def test_create_loader_errors(model, load_format, message):
    with pytest.raises((WeightLoadError, ConfigError), match=message):
        create_loader(model, load_format=load_format)


def test_directory_without_weights(tmp_path):
    with pytest.raises(WeightLoadError, match="no config.json"):
        create_loader(str(tmp_path))
    shutil.copy(PRESET_DIR / "smollm2-135m.json", tmp_path / "config.json")
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        create_loader(str(tmp_path))


def test_embedded_package_missing(monkeypatch):
    import engine.weights.base as base

    monkeypatch.setattr(base.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(WeightLoadError, match="make install"):
        create_loader(EMBEDDED_MODEL)
