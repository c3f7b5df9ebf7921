"""Whole-layer streaming through the layer store's ring (engine/offload/ring.py) on its own: streamed layers come
back bit for bit in whichever ring buffer they land, the ring is allocated once, a streamed
weight is never applied outside acquire/release, out-of-order use is refused, a failed forward
recovers, a failed load fails the forward that waits for it, and a CUDA copy engine (when a GPU is
lent) streams the same bytes."""
import os

import pytest
import torch

from engine.device.cores import CoreAssignment
from engine.offload.layer_store import create_layer_store
from engine.offload.ring import StreamedWeight
from engine.model_config import ModelConfig
from engine.quant import create_linear_method
from engine.weights import layer_shapes
from engine.weights.layer_files import ConversionKey, LayerFiles
from engine.weights.layer_image import LINEAR_NAMES
from scheduler.planning import (
    TIER_GPU,
    TIER_DISK,
    TIER_HOST,
    ForwardTimeline,
    MemoryBreakdown,
    ThroughputEstimate,
    WeightPlacement,
)
from scheduler.planning.layer_plan import ModelPlan

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=5,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=128, tie_word_embeddings=True, attention_bias=True)
TIERS = (TIER_HOST, TIER_GPU, TIER_DISK, TIER_HOST, TIER_DISK)


def placement(tiers=TIERS, num_buffers: int = 2) -> WeightPlacement:
    memory = MemoryBreakdown(*([0] * 9))
    estimate = ThroughputEstimate(1, 1, ForwardTimeline(1.0, 1.0, 1.0, 0.0))
    return WeightPlacement("auto", tuple(tiers), "performance", num_buffers, 0, memory, estimate,
                           {TIER_HOST: 0.0, TIER_DISK: 0.0})


def loaded_layers(seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{key: torch.randn(shape, generator=generator) for key, shape in layer_shapes(CONFIG).items()}
            for _ in range(CONFIG.num_layers)]


def build(tmp_path, tiers=TIERS, num_buffers=2, method="dense", device="cpu"):
    files = LayerFiles(tmp_path / "offload", ConversionKey.create("test", torch.float32, "none", torch.device(device)),
                       CONFIG.num_layers)
    store = create_layer_store(ModelPlan.compose(CONFIG.num_layers, placement(tiers, num_buffers)), torch.device(device), CoreAssignment.for_device("cpu"),
                               files, num_io_threads=2, gpu_weight_budget_bytes=None, global_weight_bytes=0)
    linear = create_linear_method(method)
    layers = [store.build(i, w, linear, torch.float32) for i, w in enumerate(loaded_layers())]
    store.start()
    return store, layers


def reference_layers(method="dense"):
    from engine.model.layer_weights import LayerWeights

    linear = create_linear_method(method)
    return [LayerWeights.from_loaded(w, linear, torch.float32, torch.device("cpu")) for w in loaded_layers()]


def forward(store, layers, x):
    """What a forward does with the weights: each layer acquired, applied, released, in order."""
    outputs = []
    for i, layer in enumerate(layers):
        store.acquire(i)
        linears = layer.named_linears()
        outputs.append([linears[name].apply(x if name != "down" else x.repeat(1, 2)) for name in
                        ("qkv", "gate_up", "down")])
        store.release(i)
    return outputs


@pytest.mark.parametrize("method", ["dense", "int4"])
def test_streamed_layers_apply_exactly_the_resident_weights_cycle_after_cycle(tmp_path, method):
    store, layers = build(tmp_path, method=method)
    try:
        x = torch.randn(3, CONFIG.hidden_size)
        expected = forward(_NoStore(), reference_layers(method), x)
        pointers = [b.data.data_ptr() for b in store.ring._buffers]
        for _ in range(3):  # 4 streamed layers through 2 buffers: each lands in another buffer each cycle
            got = forward(store, layers, x)
            assert all(torch.equal(a, b) for ga, ea in zip(got, expected) for a, b in zip(ga, ea))
        assert [b.data.data_ptr() for b in store.ring._buffers] == pointers  # the ring is never reallocated
        stats = store.stats
        layer_bytes = store.ring.items[0].image.nbytes
        assert stats.bytes_by_tier[TIER_HOST] >= 3 * 2 * layer_bytes and stats.bytes_by_tier[TIER_DISK] > 0
        assert isinstance(layers[0].qkv, StreamedWeight) and layers[0].qkv.tier == TIER_HOST
        assert not isinstance(layers[1].qkv, StreamedWeight)
    finally:
        store.close()


class _NoStore:
    def acquire(self, layer):
        pass

    def release(self, layer):
        pass


def test_a_streamed_weight_is_never_applied_outside_acquire(tmp_path):
    store, layers = build(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="layer 0's weights are not on the GPU"):
            layers[0].qkv.apply(torch.randn(1, CONFIG.hidden_size))
        store.acquire(0)
        layers[0].qkv.apply(torch.randn(1, CONFIG.hidden_size))
        store.release(0)
        with pytest.raises(RuntimeError, match="not on the GPU"):
            layers[0].qkv.apply(torch.randn(1, CONFIG.hidden_size))
    finally:
        store.close()


def test_out_of_order_use_is_refused_and_a_failed_forward_recovers(tmp_path):
    store, layers = build(tmp_path)
    x = torch.randn(2, CONFIG.hidden_size)
    try:
        with pytest.raises(RuntimeError, match="expected layer 0, got 2"):
            store.acquire(2)
        store.acquire(0)
        store.acquire(2)  # layer 1 is resident: the next streamed layer is 2
        with pytest.raises(RuntimeError, match="layer 2 released out of order"):
            store.release(2)
        store.recover()  # the forward failed half-way: start the cycle again
        expected = forward(_NoStore(), reference_layers(), x)
        got = forward(store, layers, x)
        assert all(torch.equal(a, b) for ga, ea in zip(got, expected) for a, b in zip(ga, ea))
    finally:
        store.close()


def test_a_failed_load_fails_the_forward_that_waits_for_it(tmp_path):
    store, layers = build(tmp_path, num_buffers=1)
    try:
        store.acquire(0)
        os.truncate(store.ring.files.path(2), 0)  # layer 2's file loses its bytes before its load
        store.release(0)
        with pytest.raises(RuntimeError, match="loading layer 2's weights failed"):
            store.acquire(2)
    finally:
        store.close()


@pytest.mark.cuda  # the copy stream, events and pinned buffers
def test_cuda_copy_engine_streams_the_same_bytes(tmp_path):
    store, layers = build(tmp_path, device="cuda")
    try:
        x = torch.randn(3, CONFIG.hidden_size)
        expected = forward(_NoStore(), reference_layers(), x)
        got = forward(store, layers, x.cuda())
        assert all(torch.allclose(a.cpu(), b, atol=1e-5) for ga, ea in zip(got, expected) for a, b in zip(ga, ea))
    finally:
        store.close()
