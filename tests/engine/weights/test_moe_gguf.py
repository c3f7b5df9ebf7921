"""Mixture-of-experts models from GGUF files written here the way llama.cpp's converter lays them
out (gguf's writer; stacked 3-D expert tensors, Q/K rows permuted for Mixtral's `llama`
architecture), against the safetensors load of the same weights and Hugging Face's logits; and
4-bit experts repacked per expert from a Q4_0 stack."""
import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from engine.runtime import ModelRunner
from engine.model_config import ModelConfig
from engine.quant.int4 import PackedInt4
from engine.weights import create_loader, expert_prefix
from engine.weights.gguf_loader import GGUFLoader
from tiny_gguf import llama_cpp_permute, new_gguf_writer
from tiny_moe import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, build_tiny_moe, check_logits_against_hf

# case -> GGUF architecture; every layer of these is a MoE layer, as llama.cpp's MoE architectures assume
GGUF_CASES = {"mixtral": "llama", "qwen3-moe-raw-top3": "qwen3moe", "qwen2-moe-shared-expert": "qwen2moe"}
EXPERT_STACKS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
ATTENTION_NAMES = {"input_layernorm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                   "o_proj": "attn_output", "post_attention_layernorm": "ffn_norm", "q_norm": "attn_q_norm",
                   "k_norm": "attn_k_norm", "router": "ffn_gate_inp", "shared_expert.gate_proj": "ffn_gate_shexp",
                   "shared_expert.up_proj": "ffn_up_shexp", "shared_expert.down_proj": "ffn_down_shexp"}
BIAS_NAMES = {"q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias"}


def write_moe_gguf(path, source, arch: str, expert_qtype: QType = QType.F32) -> None:
    """The weights of `source` (a safetensors loader, checked against HF elsewhere) as a GGUF file
    of architecture `arch`; expert stacks of type `expert_qtype`, everything else F32."""
    config: ModelConfig = source.config
    moe = config.moe
    writer = new_gguf_writer(path, arch, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(moe.num_experts)
    writer.add_expert_used_count(moe.num_experts_per_token)
    writer.add_expert_feed_forward_length(moe.expert_intermediate_size)
    if not moe.normalize_top_k:
        writer.add_expert_weights_norm(False)
    if moe.has_shared_expert:
        writer.add_expert_shared_feed_forward_length(moe.shared_expert_intermediate_size)

    def add(name: str, tensor: torch.Tensor, qtype: QType = QType.F32) -> None:
        array = tensor.float().numpy()
        writer.add_tensor(name, gguf.quants.quantize(array, qtype) if qtype != QType.F32 else array, raw_dtype=qtype)

    globals_ = source.load_globals(torch.float32)
    add("token_embd.weight", globals_["embed_tokens"])
    add("output_norm.weight", globals_["norm"])
    add("output.weight", globals_["lm_head"])
    permuted = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads} if arch == "llama" else {}
    for index in range(config.num_layers):
        layer = source.load_layer(index, torch.float32)
        for key, name in ATTENTION_NAMES.items():
            if key in layer:
                weight = layer[key]
                if key in permuted:
                    weight = torch.from_numpy(llama_cpp_permute(weight.numpy(), permuted[key]))
                add(f"blk.{index}.{name}.weight", weight)
        for key, name in BIAS_NAMES.items():
            if key in layer:
                add(f"blk.{index}.{name}", layer[key])
        if "shared_expert_gate" in layer:  # llama.cpp keeps it as a vector
            add(f"blk.{index}.ffn_gate_inp_shexp.weight", layer["shared_expert_gate"].reshape(-1))
        for projection, name in EXPERT_STACKS.items():
            stack = torch.stack([layer[f"{expert_prefix(e)}{projection}"] for e in range(moe.num_experts)])
            add(f"blk.{index}.{name}.weight", stack, expert_qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(GGUF_CASES))
def moe_files(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_tiny_moe(request.param, directory)
    gguf_path = directory / "model.gguf"
    write_moe_gguf(gguf_path, create_loader(str(directory), load_format="safetensors"), GGUF_CASES[request.param])
    return hf_model, str(directory), str(gguf_path)


def test_gguf_moe_config_and_layers_equal_the_safetensors_load(moe_files):
    _, hf_dir, gguf_path = moe_files
    from_st, from_gguf = create_loader(hf_dir), create_loader(gguf_path)
    assert isinstance(from_gguf, GGUFLoader)
    assert from_gguf.config.architecture == from_st.config.architecture
    assert from_gguf.config.moe == from_st.config.moe
    assert from_gguf.config.qk_norm == from_st.config.qk_norm
    assert from_gguf.config.attention_bias == from_st.config.attention_bias
    for index in range(from_st.config.num_layers):
        expected, got = from_st.load_layer(index, torch.float32), from_gguf.load_layer(index, torch.float32)
        assert set(got) == set(expected)
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


def test_gguf_moe_logits_match_hf(moe_files):
    """Prefill then paged decodes from the GGUF load, against HF's model of the same weights."""
    hf_model, _, gguf_path = moe_files
    loader = create_loader(gguf_path)
    runner = ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=NUM_BLOCKS,
                         block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    check_logits_against_hf(runner, hf_model, prompt_lengths=[6, 11], num_steps=3, seed=4)


def test_q4_0_expert_stacks_repack_per_expert(tmp_path):
    """A Q4_0 expert stack comes to the int4 method as one PackedInt4 per expert, each the exact
    4-bit form of that expert's slice; the dense load dequantizes the same values."""
    hf_dir = tmp_path / "hf"
    build_tiny_moe("mixtral", hf_dir)
    gguf_path = tmp_path / "q4.gguf"
    write_moe_gguf(gguf_path, create_loader(str(hf_dir)), "llama", expert_qtype=QType.Q4_0)
    loader = create_loader(str(gguf_path))
    packed, dense = loader.load_layer_packed(1, torch.float32), loader.load_layer(1, torch.float32)
    moe = loader.config.moe
    for e in range(moe.num_experts):
        for projection in EXPERT_STACKS:
            key = f"{expert_prefix(e)}{projection}"
            assert isinstance(packed[key], PackedInt4), key
            assert packed[key].shape == tuple(dense[key].shape), key
            torch.testing.assert_close(packed[key].dequantize(), dense[key], rtol=0, atol=0)
    assert not isinstance(packed["router"], PackedInt4)  # the router stays dense
