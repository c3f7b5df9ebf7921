"""A routed layer over the hot-expert cache equals the resident layer bit for bit, whatever is hot and
however big the batch (a decode's concatenated sum, a prefill's expert-by-expert one), on a tiny
Qwen3-MoE with top-3 of 4 experts: with top-2 a token's two outputs add up the same in either order,
so only three or more can show a summing order wrong."""
import random

import pytest
import torch

from engine.attention import create_decode_backend
from engine.device.cores import CoreAssignment
from engine.offload.experts.store import create_expert_store
from engine.offload.stats import WeightStats
from engine.model.moe import SparseMoe
from engine.model.registry import create_model
from engine.weights import create_loader
from scheduler.planning import WeightFormat
from scheduler.planning.experts.hot_experts import plan_expert_cache
from scheduler.planning.memory import resident_global_bytes
from tiny_moe import build_tiny_moe

NUM_SLOTS = 2


@pytest.fixture(scope="module")
def cached_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("top3")
    build_tiny_moe("qwen3-moe-raw-top3", path)
    loader = create_loader(str(path))
    shape = loader.config.shape
    plan = plan_expert_cache(shape, WeightFormat("none", 4), resident_global_bytes(shape, 4), None,
                             num_slots=NUM_SLOTS, num_fetch_buffers=0)
    store = create_expert_store(plan, torch.device("cpu"), CoreAssignment.for_device("cpu"), WeightStats())
    model = create_model(loader.config, loader, torch.float32, "cpu", 64, create_decode_backend("torch"),
                         layer_store=store)
    yield model
    store.close()


@torch.no_grad()
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_a_routed_layer_equals_the_resident_one_bit_for_bit_whatever_is_hot(cached_model, num_tokens):
    model, cache = cached_model, cached_model.layer_store.cache
    rng, generator = random.Random(num_tokens), torch.Generator().manual_seed(num_tokens)
    for layer, entry in cache.layers.items():
        moe = model.layers[layer].mlp
        resident = SparseMoe(moe.router, moe.experts, moe.shared)
        for _ in range(3):
            for expert in rng.sample(range(len(entry.images)), NUM_SLOTS):
                cache.promote(layer, expert)
            cache.settle()
            x = torch.randn(num_tokens, model.config.hidden_size, generator=generator)
            assert torch.equal(moe.apply(x, model.silu_mul), resident.apply(x, model.silu_mul))
