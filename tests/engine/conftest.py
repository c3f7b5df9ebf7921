"""Fixtures shared by the engine tests' modules."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def embedded_hf_model():
    """The embedded GGUF as Hugging Face transformers loads it (dequantized to float32, in eval
    mode): the weight loader's tests read its tensors, the generation tests its greedy tokens.
    Loading dequantizes every tensor in Python, so it is loaded once; and it reads the file's metadata
    with the GGUF reader tandem's loader uses (the `gguf` package's parse, over a plain view of the
    map) and builds the package's tensor-name map once, not per tensor: 25 s to load became 8."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from engine.weights import embedded_gguf_path
    from engine.weights.gguf_loader import GgufReader

    path = embedded_gguf_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", GgufReader)
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def references():
    """reference(model, cpu_attention) -> the greedy tokens of test_weight_streaming's workload for
    `cpu_attention`, with every layer resident and offloading off: the same prompts give the same
    tokens whatever the plans. One engine per model for the session: the streamed, sliced and
    offloaded runs of several modules compare with it."""
    from engine import LLM
    from test_weight_streaming import generate, workload

    engines, tokens = {}, {}

    def reference(model: dict, cpu_attention: str) -> list:
        model_key = tuple(sorted(model.items()))
        if (model_key, cpu_attention) not in tokens:
            if model_key not in engines:
                engines[model_key] = LLM(**model, cpu_attention="off")
            tokens[model_key, cpu_attention] = generate(engines[model_key], *workload(model, cpu_attention))[0]
        return tokens[model_key, cpu_attention]

    yield reference
    for llm in engines.values():
        llm.close()
