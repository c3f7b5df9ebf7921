"""GGUF tensor types against gguf-py's own dequantization: 4-bit blocks repacked into int4.h's
layout bit for bit, every other type dequantized, and the load log naming what each became."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from engine.quant.int4 import PackedInt4
from engine.weights import create_loader
from kernels.cpu import int4
from tiny_gguf import write_tiny_gguf


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
            in_cpp = int4.dequantize_into(weight.qweight, weight.scales, weight.mins, weight.group_size,
                                          torch.empty(weight.shape))
            assert torch.equal(in_cpp, expected[index][key]), f"seed {seed}: {index}.{key} (C++)"
