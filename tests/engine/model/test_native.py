"""The C++ decoder (engine/model/native.py, kernels/cpu/decoder.h) against the op-by-op path.

With this CPU's best kernels it must give the very bits the op-by-op fused path gives (it calls
the same kernels with the same roundings): stage by stage on the embedded model (INT4 and dense)
and on a tiny random model with a bias, and whole decode steps' logits through the runner. Every
instruction set this CPU has is checked against the torch-op path within rounding, and a decode
over INT8/INT4 KV pools against the stages with the plain quantized-KV reference.
"""
import pytest
import torch
import transformers

from engine.attention import AttentionMetadata, create_decode_backend
from engine.runtime import ModelRunner
from engine.model import LlamaModel
from engine.model.native import NativeDecoder
from engine.quant import create_linear_method
from engine.weights import create_loader, embedded_gguf_path
from kernels import cpu, kv_quant
from tiny_qwen2 import save_tiny_qwen2  # tests/ is on sys.path through tests/conftest.py
from kernels.cpu import reference
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the CPU kernels are not built")
ISAS = cpu.usable_isas() if cpu.is_available() else []
INTEGER_DOTS = bool(ISAS) and ISAS[0] in cpu.integer_dot_isas()  # the native decoder's: the best usable
BLOCK_SIZE = 4
# A tiny Qwen2 (Q/K/V biases) whose widths the C++ decoder takes: head_dim 32.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), **TINY)


def op_by_op_model(path: str, dtype: torch.dtype, method: str) -> LlamaModel:
    loader = create_loader(path)
    return LlamaModel(loader.config, loader, dtype, "cpu", 256, create_decode_backend("cpu", "cpu"),
                      linear_method=create_linear_method(method), cpu_ops="fused")


MODELS = {  # name -> (path factory, dtype, linear method)
    "embedded-int4-bf16": (lambda tiny: str(embedded_gguf_path()), torch.bfloat16, "int4"),
    "embedded-dense-bf16": (lambda tiny: str(embedded_gguf_path()), torch.bfloat16, "dense"),
    "tiny-qwen2-bias-fp32": (lambda tiny: tiny, torch.float32, "dense"),
    "tiny-qwen2-bias-bf16": (lambda tiny: tiny, torch.bfloat16, "dense"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tiny_path):
    path_of, dtype, method = MODELS[request.param]
    return op_by_op_model(path_of(tiny_path), dtype, method)


def stage_inputs(model: LlamaModel, tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    hidden = torch.randn(tokens, cfg.hidden_size, generator=gen).to(model.dtype)
    positions = torch.randint(0, 200, (tokens,), generator=gen)
    attn = torch.randn(tokens, cfg.num_heads * cfg.head_dim, generator=gen).to(model.dtype)
    return hidden, positions, attn


def test_stages_give_the_op_by_op_bits(model):
    native = NativeDecoder.build(model)
    for tokens in sorted({1, 3, native.max_tokens}):
        hidden, positions, attn = stage_inputs(model, tokens, seed=tokens)
        for layer in (0, model.config.num_layers - 1):
            for got, want in zip(native.pre_proj(layer, hidden, positions), model.pre_proj(layer, hidden, positions)):
                assert torch.equal(got, want), (tokens, layer)
            assert torch.equal(native.post_proj(layer, hidden, attn), model.post_proj(layer, hidden, attn))


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_matches_the_torch_ops(tiny_path, isa):
    model = op_by_op_model(tiny_path, torch.float32, "dense")
    native = NativeDecoder.build(model, isa=isa)
    model.rms_norm = __import__("engine.model.layers", fromlist=["rms_norm"]).rms_norm
    model.rope.fused = False  # the reference: torch ops throughout
    hidden, positions, attn = stage_inputs(model, 4, seed=7)
    for got, want in zip(native.pre_proj(1, hidden, positions), model.pre_proj(1, hidden, positions)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(native.post_proj(1, hidden, attn), model.post_proj(1, hidden, attn),
                               atol=1e-5, rtol=1e-5)


def decode_logits(path: str, dtype: torch.dtype, cpu_ops: str, steps: int = 5) -> list[torch.Tensor]:
    """Logits of a few batched decode steps after mixed-length prefills, teacher-forced."""
    loader = create_loader(path)
    runner = ModelRunner(loader.config, loader, dtype=dtype, device="cpu", num_blocks=64, block_size=BLOCK_SIZE,
                         max_model_len=128, decode_backend="cpu", cpu_ops=cpu_ops)
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=128))
    gen = torch.Generator().manual_seed(3)
    for i, n in enumerate([7, 1, 16]):
        sched.add_sequence(Sequence(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(),
                                    SamplingParams(max_tokens=20)))
    logits = []
    for _ in range(steps):
        plan = sched.schedule()
        logits.append(runner.compute_logits(plan))
        sched.update(plan, torch.randint(0, 256, (len(plan.scheduled),), generator=gen).tolist())
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_decode_steps_give_the_op_by_op_logits(tiny_path, dtype, monkeypatch):
    calls = []
    original = NativeDecoder.decode
    monkeypatch.setattr(NativeDecoder, "decode", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    native = decode_logits(tiny_path, dtype, "layers")
    assert calls, "the decode steps did not go through the C++ decoder"
    for got, want in zip(native, decode_logits(tiny_path, dtype, "fused")):
        assert torch.equal(got, want)


def test_models_it_does_not_cover_run_op_by_op(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "num_attention_heads": 8})  # head_dim 16: no C++ RoPE
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    loader = create_loader(str(tmp_path))
    model = LlamaModel(loader.config, loader, torch.float32, "cpu", 128, create_decode_backend("cpu", "cpu"))
    assert model.native is None


def test_a_mixed_batch_or_too_many_rows_take_the_op_by_op_stages(tiny_path):
    model = op_by_op_model(tiny_path, torch.float32, "dense")
    native = NativeDecoder.build(model)
    assert native.max_tokens == cpu.DENSE_LINEAR_MAX_ROWS  # dense weights: the GEMV's rows
    hidden, _, _ = stage_inputs(model, native.max_tokens + 1, seed=1)
    assert not native.applies(hidden)
    meta = AttentionMetadata([3], 3, torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                             None, None)
    model.native = native
    assert not model._native_decode_applies(hidden[:3], meta, None)


# The tiny Qwen2 with 64-wide heads: the quantized KV formats' group is 64 channels.
TINY_HEAD_64 = {**TINY, "hidden_size": 256}
QUANT_BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_head_64_path(tmp_path_factory):
    torch.manual_seed(1)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY_HEAD_64),
                                                             torch_dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-qwen2-head-64")
    hf_model.save_pretrained(path, safe_serialization=True)
    return str(path)


def quantized_pools(fmt: str, cfg, num_blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's key and value pools [layers, blocks, kv_heads, unit_bytes], each slot quantized from random rows."""
    layout = kv_quant.layout_for(fmt, cfg.head_dim, QUANT_BLOCK_SIZE)
    pools = tuple(torch.zeros(cfg.num_layers, num_blocks, cfg.num_kv_heads, side.unit_bytes, dtype=torch.uint8)
                  for side in (layout.key, layout.value))
    blocks = torch.arange(num_blocks).repeat_interleave(QUANT_BLOCK_SIZE)
    offsets = torch.arange(QUANT_BLOCK_SIZE).repeat(num_blocks)
    for pool, is_key in zip(pools, (True, False)):
        side = layout.side(is_key)
        for layer in range(cfg.num_layers):
            rows = torch.randn(len(blocks), cfg.num_kv_heads, cfg.head_dim, generator=gen)
            kv_quant.write_rows(kv_quant.unit_views(pool[layer], side, is_key), side, rows, blocks, offsets)
    return pools


@pytest.mark.parametrize("fmt", sorted(kv_quant.FORMAT_CODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_quantized_pools_matches_the_op_by_op_stages(tiny_head_64_path, fmt, dtype):
    # The reference runs each layer op by op: the model's stages, the new K/V quantized by
    # kv_quant.write_rows, the torch spec of the kernel's attention. The pools must come out
    # byte for byte the same, the hidden states within the attention's fp32 summation order.
    model = op_by_op_model(tiny_head_64_path, dtype, "dense")
    native = NativeDecoder.build(model)
    cfg = model.config
    gen = torch.Generator().manual_seed(5)
    context_lens = torch.tensor([5, 40, 100], dtype=torch.int32)
    block_tables = torch.randperm(24, generator=gen, dtype=torch.int32).view(3, 8)
    positions = context_lens.long() - 1
    hidden = torch.randn(3, cfg.hidden_size, generator=gen).to(dtype)
    key, value = quantized_pools(fmt, cfg, 24, gen)
    ref_key, ref_value = key.clone(), value.clone()

    got = native.decode(hidden, positions, key, value, block_tables, context_lens, model.scale, kv_format=fmt,
                        block_size=QUANT_BLOCK_SIZE)

    layout = kv_quant.layout_for(fmt, cfg.head_dim, QUANT_BLOCK_SIZE)
    slot_blocks = block_tables[torch.arange(3), positions // QUANT_BLOCK_SIZE].long()
    want = hidden
    for layer in range(cfg.num_layers):
        q, k, v = model.pre_proj(layer, want, positions)
        for pool, rows, is_key in ((ref_key[layer], k, True), (ref_value[layer], v, False)):
            side = layout.side(is_key)
            kv_quant.write_rows(kv_quant.unit_views(pool, side, is_key), side, rows, slot_blocks,
                                positions % QUANT_BLOCK_SIZE)
        attn = reference.quantized_pool_attention(q, ref_key[layer], ref_value[layer], block_tables, context_lens,
                                                  model.scale, layout, INTEGER_DOTS)
        want = model.post_proj(layer, want, attn.to(dtype).view(3, -1))
    # In bf16 a later layer's new K/V may round across a code boundary once the attention's order of
    # summation (or, with integer dot products, one value weight's u8 rounding) differs: layer 0 only.
    layers = slice(None) if dtype == torch.float32 else slice(0, 1)
    assert torch.equal(key[layers], ref_key[layers]) and torch.equal(value[layers], ref_value[layers])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_decode_refuses_quantized_pools_of_the_wrong_shape(tiny_head_64_path):
    model = op_by_op_model(tiny_head_64_path, torch.float32, "dense")
    native = NativeDecoder.build(model)
    key, value = quantized_pools("int4", model.config, 4, torch.Generator().manual_seed(0))
    args = (torch.zeros(1, model.config.hidden_size), torch.zeros(1, dtype=torch.int64), key, value,
            torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), model.scale)
    with pytest.raises(ValueError, match="needs block_size"):
        native.decode(*args, kv_format="int4")
    with pytest.raises(ValueError, match="pools must be uint8"):
        native.decode(*args, kv_format="int8", block_size=QUANT_BLOCK_SIZE)
