"""GGUF tensor types against gguf-py's own dequantization: 4-bit blocks repacked into int4.h's
layout bit for bit, every other type dequantized, the load log naming what each became, and a
tiny model of mixed types generating alike under --quantization int4 and none."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from engine.runtime import ModelRunner
from engine.quant.base import ConcatWeight
from engine.quant.int4 import KeepDense, PackedInt4
from engine.weights import create_loader
from engine.weights.gguf_loader import SUPPORTED_TYPES
from kernels.cpu import int4
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence
from tiny_gguf import GGUF_SHAPE, write_tiny_gguf

LOADER_LOG = "engine.weights.gguf_loader"
NUM_LINEAR_WEIGHTS = GGUF_SHAPE["num_layers"] * 7  # q, k, v, o, gate, up, down
REPACKED = {QType.Q4_0, QType.Q4_1, QType.Q4_K}
FLOATS = {QType.F32, QType.F16, QType.BF16}


def fresh_seed() -> int:
    """A new seed each run, named in failure messages so that a failure can be replayed."""
    return int(np.random.SeedSequence().entropy % 2**32)


def test_q4_k_repacked_exactly_on_fresh_random_blocks(tmp_path):
    """Random Q4_K super-blocks (random 6-bit scales and mins, codes, fp16 d and dmin of both
    signs, subnormals included): every linear weight comes packed, and both the Python and the
    C++ dequantization of the packed form equal gguf-py's values exactly, Q/K rows unpermuted."""
    seed = fresh_seed()
    path = tmp_path / "q4_k.gguf"
    expected, _ = write_tiny_gguf(path, qtype=QType.Q4_K, seed=seed)
    loader = create_loader(str(path))
    for index in range(loader.config.num_layers):
        for key, weight in loader.load_layer_packed(index, torch.float32).items():
            if not key.endswith("_proj"):
                continue
            assert isinstance(weight, PackedInt4) and weight.group_size == 32, key
            assert torch.equal(weight.dequantize(), expected[index][key]), f"seed {seed}: {index}.{key}"
            tiled = int4.TiledInt4.from_packed(weight.qweight, weight.scales, weight.mins, weight.group_size)
            in_cpp = int4.dequantize_into(tiled, torch.empty(weight.shape))
            assert torch.equal(in_cpp, expected[index][key]), f"seed {seed}: {index}.{key} (C++)"


def int4_words(qtype: QType) -> str:
    """What the load log must say a linear weight of `qtype` becomes under int4 (float32)."""
    if qtype in REPACKED:
        return "int4, packed as stored"
    if qtype in FLOATS:
        return "read as float32, then int4 by round-to-nearest"
    return "dequantized to float32, kept dense"


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda qtype: qtype.name)
def test_each_type_for_int4_matches_gguf_and_is_logged(tmp_path, caplog, qtype):
    """Under int4 a linear weight comes packed (Q4_0/Q4_1/Q4_K), as KeepDense (the other
    quantized types) or plain (float types, for the method to quantize), always with exactly
    gguf-py's values; the embeddings and LM head come dense; the log names each outcome."""
    seed = fresh_seed()
    path = tmp_path / "tiny.gguf"
    expected, _ = write_tiny_gguf(path, qtype=qtype, seed=seed)
    loader = create_loader(str(path))
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        layers = [loader.load_layer_packed(index, torch.float32) for index in range(loader.config.num_layers)]
    for index, layer in enumerate(layers):
        for key, weight in layer.items():
            if not key.endswith("_proj"):
                assert isinstance(weight, torch.Tensor), key
                values = weight
            elif qtype in REPACKED:
                assert isinstance(weight, PackedInt4), key
                values = weight.dequantize()
            elif qtype in FLOATS:
                assert isinstance(weight, torch.Tensor), key
                values = weight
            else:
                assert isinstance(weight, KeepDense), key
                values = weight.weight
            torch.testing.assert_close(values, expected[index][key], rtol=0, atol=0, msg=f"seed {seed}: {index}.{key}")
    for key, tensor in loader.load_globals(torch.float32).items():
        torch.testing.assert_close(tensor, expected["globals"][key], rtol=0, atol=0, msg=f"seed {seed}: {key}")
    global_words = "read as float32" if qtype in FLOATS else "dequantized to float32"
    assert caplog.records[-1].getMessage() == (
        f"tiny.gguf: the embeddings (token_embd.weight, {qtype.name}) -> {global_words}, kept dense; "
        f"the LM head (output.weight, {qtype.name}) -> {global_words}, kept dense; "
        f"{NUM_LINEAR_WEIGHTS} {qtype.name} linear weights -> {int4_words(qtype)}"
    )


def test_dense_load_log_names_each_type(tmp_path, caplog):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=QType.Q6_K, tie=True, types={"blk.1.ffn_down.weight": QType.F16})
    loader = create_loader(str(path))
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        loader.load_layer(0, torch.bfloat16)
    assert caplog.records[-1].getMessage() == (
        "tiny.gguf: the embeddings and LM head (token_embd.weight, Q6_K) -> dequantized to bfloat16; "
        f"{NUM_LINEAR_WEIGHTS - 1} Q6_K linear weights -> dequantized to bfloat16; "
        "1 F16 linear weight -> read as bfloat16"
    )


# Every quantized family in one file, as llama.cpp's mixes do (Q4_K_M holds V and down in Q6_K);
# no float linear weight, so that int4 and none load the very same values.
MIXED_TYPES = {
    "token_embd.weight": QType.Q4_K,
    "output.weight": QType.Q6_K,
    "blk.0.attn_q.weight": QType.Q4_K,
    "blk.0.attn_k.weight": QType.Q4_K,
    "blk.0.attn_v.weight": QType.Q6_K,
    "blk.0.attn_output.weight": QType.Q4_0,
    "blk.0.ffn_gate.weight": QType.Q4_1,
    "blk.0.ffn_up.weight": QType.Q5_K,
    "blk.0.ffn_down.weight": QType.Q8_0,
    "blk.1.attn_q.weight": QType.Q5_0,
    "blk.1.attn_k.weight": QType.Q5_1,
    "blk.1.attn_v.weight": QType.Q4_K,
    "blk.1.attn_output.weight": QType.Q2_K,
    "blk.1.ffn_gate.weight": QType.Q3_K,
    "blk.1.ffn_up.weight": QType.Q4_K,
    "blk.1.ffn_down.weight": QType.Q4_K,
}
MIXED_INT4_LOG = (
    "mixed.gguf: the embeddings (token_embd.weight, Q4_K) -> dequantized to float32, kept dense; "
    "the LM head (output.weight, Q6_K) -> dequantized to float32, kept dense; "
    "5 Q4_K linear weights -> int4, packed as stored; "
    "1 Q2_K linear weight -> dequantized to float32, kept dense; "
    "1 Q3_K linear weight -> dequantized to float32, kept dense; "
    "1 Q4_0 linear weight -> int4, packed as stored; "
    "1 Q4_1 linear weight -> int4, packed as stored; "
    "1 Q5_0 linear weight -> dequantized to float32, kept dense; "
    "1 Q5_1 linear weight -> dequantized to float32, kept dense; "
    "1 Q5_K linear weight -> dequantized to float32, kept dense; "
    "1 Q6_K linear weight -> dequantized to float32, kept dense; "
    "1 Q8_0 linear weight -> dequantized to float32, kept dense"
)


def greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int = 8) -> tuple[list, list]:
    """Greedy tokens of each prompt, batched, and the logits of every step."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=32, block_size=16, max_model_len=128))
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add_sequence(seq)
    logits = []
    while scheduler.has_unfinished_sequences():
        plan = scheduler.schedule()
        step_logits = runner.compute_logits(plan)
        logits.append(step_logits)
        scheduler.update(plan, step_logits.argmax(dim=-1).tolist())
    return [seq.output_token_ids for seq in seqs], logits


# Relative to the largest logit: int8 activations in every int4 matmul of the layers, compounded.
PREFILL_LOGIT_TOLERANCE = 5e-2


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@torch.no_grad()
def test_mixed_types_generate_alike_under_int4_and_none(tmp_path, caplog, architecture):
    """A tiny model of mixed types loads under int4 (Q4 types packed, fused QKV and gate/up of
    several kinds as ConcatWeight, Qwen2's QKV bias split across its parts) and under none, and
    both give the same first greedy tokens and prefill logits within what the kernel's int8
    activations cost (a misplaced part or bias would be off by the logits' own size); the
    decode steps, which feed back tokens of near-uniform random-weight logits, are not compared."""
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path, architecture=architecture, types=MIXED_TYPES)
    loader = create_loader(str(path))
    runners = {}
    with caplog.at_level(logging.INFO, logger=LOADER_LOG):
        for method in ("int4", "dense"):
            runners[method] = ModelRunner(loader.config, loader, dtype=torch.float32, device="cpu", num_blocks=32,
                                          block_size=16, max_model_len=128, linear_method=method)
    int4_log = [r.getMessage() for r in caplog.records if r.name == LOADER_LOG][0]
    assert int4_log == MIXED_INT4_LOG
    first = runners["int4"].model.layers[0]
    assert isinstance(first.qkv, ConcatWeight) and [p.format for p in first.qkv.parts] == ["int4", "float32"]
    assert isinstance(first.mlp.gate_up, ConcatWeight) and [p.format for p in first.mlp.gate_up.parts] == ["int4", "float32"]
    assert (first.o_proj.format, first.mlp.down.format) == ("int4", "float32")
    assert {fmt for fmt, _ in runners["int4"].model.weight_bytes()} == {"int4", "float32"}

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, loader.config.vocab_size, (n,), generator=gen).tolist() for n in (12, 20, 5)]
    tokens_int4, logits_int4 = greedy(runners["int4"], prompts)
    tokens_dense, logits_dense = greedy(runners["dense"], prompts)
    assert [t[0] for t in tokens_int4] == [t[0] for t in tokens_dense]
    prefill_error = (logits_int4[0] - logits_dense[0]).abs().max() / logits_dense[0].abs().max()
    assert prefill_error <= PREFILL_LOGIT_TOLERANCE

