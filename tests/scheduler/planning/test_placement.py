"""The weight placement planner (scheduler/planning): budgets are never exceeded, a model that
fits nowhere is refused with what to change, the pipeline and the number of resident layers are
chosen by estimated throughput, and the simulated pipeline overlaps what it should. No torch."""
import itertools

import pytest

from scheduler.planning.cost_model import Curve, ModelShape
from scheduler.planning import (
    GIB_BYTES,
    PIPELINE_MEMORY,
    PIPELINE_PERFORMANCE,
    TIER_GPU,
    TIER_DISK,
    TIER_HOST,
    ComputeCosts,
    MemoryBudgets,
    PlacementError,
    PlannerInputs,
    TransferRates,
    WeightFormat,
    Workload,
    describe,
    layer_image_bytes,
    plan_placement,
    simulate_forward,
)
from scheduler.planning.memory import image_layout, resident_global_bytes
from scheduler.planning.placement import candidate_placement, spread

# A 1B Llama-3.2 shape: 16 layers of ~116 MiB in bf16, embeddings ~0.5 GiB
SHAPE = ModelShape(num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8,
                   head_dim=64, vocab_size=128256, tie_word_embeddings=True)
BF16 = WeightFormat("none", 2)
LAYER = layer_image_bytes(SHAPE, BF16)
GLOBALS = resident_global_bytes(SHAPE, 2)
WORKLOAD = Workload(max_num_seqs=32, max_model_len=1024, max_num_batched_tokens=1024, block_size=16, context_len=512)


def costs(layer_s: float = 0.01) -> ComputeCosts:
    """Linear work flat in tokens (weight-bound), cheap attention and head."""
    return ComputeCosts(Curve.from_points([(1, layer_s), (64, layer_s * 1.1)]), 1e-9, Curve.from_points([(1, 1e-3)]))


def inputs(budgets: MemoryBudgets, link_s_per_layer: float = 0.01, disk_s_per_layer: float | None = 0.05,
           mode: str = "auto", pipeline: str = "auto", workload: Workload = WORKLOAD, fmt: WeightFormat = BF16,
           layer_s: float = 0.01) -> PlannerInputs:
    rates = TransferRates(LAYER / link_s_per_layer, LAYER / disk_s_per_layer if disk_s_per_layer else None)
    return PlannerInputs(SHAPE, fmt, workload, budgets, rates, costs(layer_s), mode, pipeline)


def test_image_layout_aligns_each_tensor_and_the_whole():
    offsets, total = image_layout([10, 300, 5])
    assert offsets == [0, 256, 768] and total == 4096
    assert LAYER % 4096 == 0
    params = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192
    assert params * 2 <= LAYER < params * 2 + 4 * 4096


def test_int4_layers_are_about_three_eighths_of_bf16():
    """4-bit codes plus an fp32 scale and min per 32 weights: 0.75 bytes a weight against 2."""
    int4 = layer_image_bytes(SHAPE, WeightFormat("int4", 2))
    assert int4 / LAYER == pytest.approx(0.375, rel=0.01)


def test_everything_resident_when_it_fits():
    placement = plan_placement(inputs(MemoryBudgets(kv_cache_bytes=GIB_BYTES)))
    assert placement.tiers == (TIER_GPU,) * 16 and placement.pipeline is None
    assert placement.num_buffers == 0 and placement.memory.buffer_bytes == 0


@pytest.mark.parametrize("weights_gib, host_gib, memory_gib", list(itertools.product(
    [0.9, 1.2, 2.0, 3.0, None], [0.5, 1.0, None], [3.0, 5.0, None])))
def test_budgets_are_never_exceeded(weights_gib, host_gib, memory_gib):
    gib = lambda value: None if value is None else int(value * GIB_BYTES)  # noqa: E731
    budgets = MemoryBudgets(gpu_weight_bytes=gib(weights_gib), gpu_bytes=gib(memory_gib),
                            kv_cache_bytes=None if memory_gib else GIB_BYTES // 2, host_weight_bytes=gib(host_gib),
                            disk_bytes=50 * GIB_BYTES, has_offload_dir=True)
    try:
        placement = plan_placement(inputs(budgets))
    except PlacementError:
        assert weights_gib is not None and weights_gib * GIB_BYTES < GLOBALS + LAYER  # not even one buffer fits
        return
    m = placement.memory
    if weights_gib is not None:
        assert m.gpu_weight_bytes <= weights_gib * GIB_BYTES
    if memory_gib is not None:
        assert m.gpu_bytes <= memory_gib * GIB_BYTES
    if host_gib is not None:
        assert m.host_layer_bytes + m.staging_bytes <= host_gib * GIB_BYTES
    counts = {tier: placement.num_layers_in(tier) for tier in (TIER_GPU, TIER_HOST, TIER_DISK)}
    assert m.resident_layer_bytes == counts[TIER_GPU] * LAYER
    assert m.host_layer_bytes == counts[TIER_HOST] * LAYER and m.disk_layer_bytes == counts[TIER_DISK] * LAYER
    assert (m.staging_bytes > 0) == (counts[TIER_DISK] > 0)


def test_nothing_fits_names_the_flag_to_change():
    with pytest.raises(PlacementError, match="--weights-gpu-gib gives 0.50 GiB; give more, or --quantization int4"):
        plan_placement(inputs(MemoryBudgets(gpu_weight_bytes=GIB_BYTES // 2, kv_cache_bytes=GIB_BYTES)))


def test_layers_beyond_host_memory_need_an_offload_dir():
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 2 * LAYER, kv_cache_bytes=GIB_BYTES,
                            host_weight_bytes=4 * LAYER)
    with pytest.raises(PlacementError, match="give --offload-dir"):
        plan_placement(inputs(budgets))
    placement = plan_placement(inputs(MemoryBudgets(**{**budgets.__dict__, "has_offload_dir": True})))
    assert placement.num_layers_in(TIER_DISK) == 16 - 2 - placement.num_layers_in(TIER_GPU)
    assert placement.memory.host_layer_bytes + placement.memory.staging_bytes <= 4 * LAYER


def test_layers_beyond_the_offload_dirs_room_are_refused_with_the_bytes_missing():
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 2 * LAYER, kv_cache_bytes=GIB_BYTES, host_weight_bytes=0,
                            disk_bytes=3 * LAYER, has_offload_dir=True)
    with pytest.raises(PlacementError) as info:
        plan_placement(inputs(budgets, mode="disk"))
    message = str(info.value)
    assert f"in --offload-dir, which has room for {3 * LAYER / GIB_BYTES:.2f} GiB" in message
    assert f"({3 * LAYER} bytes: its free space and the layer files there)" in message
    assert "bytes) missing; free space there, or point --offload-dir" in message


def test_gpu_mode_refuses_a_model_that_does_not_fit_and_cpu_mode_streams_everything():
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 4 * LAYER, kv_cache_bytes=GIB_BYTES)
    with pytest.raises(PlacementError, match="16 resident layers"):
        plan_placement(inputs(budgets, mode="gpu"))
    placement = plan_placement(inputs(budgets, mode="cpu"))
    assert placement.tiers == (TIER_HOST,) * 16


def test_performance_pipeline_when_two_buffers_fit_memory_efficient_when_one():
    """All streamed (budget for globals and at most two buffers): with room for two the next
    layer preloads; with room for one, only the memory-efficient pipeline fits."""
    two = MemoryBudgets(gpu_weight_bytes=GLOBALS + 2 * LAYER, kv_cache_bytes=GIB_BYTES)
    placement = plan_placement(inputs(two, mode="cpu"))
    assert placement.pipeline == PIPELINE_PERFORMANCE and placement.num_buffers == 2
    one = MemoryBudgets(gpu_weight_bytes=GLOBALS + LAYER, kv_cache_bytes=GIB_BYTES)
    placement = plan_placement(inputs(one, mode="cpu"))
    assert placement.pipeline == PIPELINE_MEMORY and placement.num_buffers == 1
    # the preload halves a balanced forward
    fast = plan_placement(inputs(two, mode="cpu")).estimate.timeline.iteration_s
    slow = placement.estimate.timeline.iteration_s
    assert slow / fast == pytest.approx(2.0, rel=0.1)


def test_two_batch_forwards_hold_two_layers():
    work = Workload(**{**WORKLOAD.__dict__, "layers_in_use": 2})
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 3 * LAYER, kv_cache_bytes=GIB_BYTES)
    placement = plan_placement(inputs(budgets, mode="cpu", workload=work))
    assert placement.pipeline == PIPELINE_PERFORMANCE and placement.num_buffers == 3
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 2 * LAYER, kv_cache_bytes=GIB_BYTES)
    assert plan_placement(inputs(budgets, mode="cpu", workload=work)).num_buffers == 2
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + LAYER, kv_cache_bytes=GIB_BYTES)
    with pytest.raises(PlacementError):
        plan_placement(inputs(budgets, mode="cpu", workload=work))


def test_resident_layers_are_weighed_against_kv_space():
    """One GPU budget: each resident layer takes KV blocks (about 3.5 sequences of 1024
    tokens). With loads nearly free and room for a bigger batch, everything streams and the KV pool
    gets the room; with slow loads and the batch capped by max_num_seqs, the planner keeps as many
    layers resident as leave the full batch its KV."""
    budgets = MemoryBudgets(gpu_bytes=GLOBALS + 12 * LAYER, disk_bytes=None)
    work = dict(max_model_len=1024, max_num_batched_tokens=1024, block_size=16, context_len=1024)
    fast = plan_placement(inputs(budgets, link_s_per_layer=1e-4, workload=Workload(max_num_seqs=256, **work)))
    slow = plan_placement(inputs(budgets, link_s_per_layer=0.5, workload=Workload(max_num_seqs=16, **work)))
    assert fast.num_layers_in(TIER_GPU) == 0 and fast.estimate.batch > 16
    assert slow.num_layers_in(TIER_GPU) > 0 and slow.estimate.batch == 16
    one_more = candidate_placement(inputs(budgets, link_s_per_layer=0.5, workload=Workload(max_num_seqs=16, **work)),
                          slow.num_layers_in(TIER_GPU) + 1, slow.pipeline)
    assert isinstance(one_more, str) or one_more.estimate.batch < 16  # one more resident layer costs batch
    for placement in (fast, slow):
        assert placement.memory.gpu_bytes <= budgets.gpu_bytes


def test_streamed_layers_are_spread_between_resident_ones():
    assert spread(2, 8) == [False, False, False, True, False, False, False, True]
    assert sum(spread(5, 16)) == 5 and spread(0, 4) == [False] * 4 and spread(4, 4) == [True] * 4
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 10 * LAYER, kv_cache_bytes=GIB_BYTES)
    placement = plan_placement(inputs(budgets, link_s_per_layer=0.05))
    resident = [i for i, tier in enumerate(placement.tiers) if tier == TIER_GPU]
    assert max(b - a for a, b in zip(resident, resident[1:])) <= 3  # no long run of streamed layers


def test_simulated_pipeline():
    # all streamed, one buffer: every load waits for the previous layer's release: serial
    serial = simulate_forward([1.0] * 4, [1.0] * 4, num_buffers=1)
    assert serial.iteration_s == pytest.approx(8.0) and serial.stall_s == pytest.approx(4.0)
    # two buffers: loads run under compute; the steady state is max(compute, transfer)
    overlapped = simulate_forward([1.0] * 4, [1.0] * 4, num_buffers=2)
    assert overlapped.iteration_s == pytest.approx(4.0)
    # transfer-bound: the forward takes the transfers' time
    assert simulate_forward([0.5] * 4, [1.0] * 4, num_buffers=2).iteration_s == pytest.approx(4.0)
    # one streamed layer among resident ones hides behind them, even with one buffer
    hidden = simulate_forward([1.0] * 4, [None, None, 2.5, None], num_buffers=1)
    assert hidden.iteration_s == pytest.approx(4.0) and hidden.stall_s == pytest.approx(0.0)
    # the head's time between forwards is used for loads too
    assert simulate_forward([1.0] * 2, [2.0] * 2, num_buffers=2, head_s=1.0).iteration_s == pytest.approx(4.0)


def test_describe_prints_the_breakdown_and_the_expectation():
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 6 * LAYER, kv_cache_bytes=GIB_BYTES,
                            host_weight_bytes=6 * LAYER, disk_bytes=10 * GIB_BYTES, has_offload_dir=True)
    placement = plan_placement(inputs(budgets))
    text = describe(placement, "/offload")
    assert "from disk in /offload" in text and "GPU" in text and "tokens/s" in text
    assert f"{placement.estimate.tokens_per_s:.1f} tokens/s" in text
    assert placement.to_dict()["tiers"] == list(placement.tiers)


def test_bad_mode_is_refused():
    with pytest.raises(PlacementError, match="weight placement must be one of"):
        inputs(MemoryBudgets(kv_cache_bytes=GIB_BYTES), mode="ssd")


def test_streaming_cost_model_stretches_linear_time_to_the_transfers():
    """The scheduler's view: a streamed placement's linear time per layer is max(compute, the
    layers' loads shared over all layers); batch-1's second pass over a layer pays no transfer."""
    from scheduler.planning.cost_model import Grid, TableCostModel
    from scheduler.planning.offload_cost import StreamingCostModel

    base = TableCostModel(num_layers=16, linear_curve=Curve.from_points([(1, 0.002), (256, 0.05)]),
                          prefill_curve=Curve.from_points([(1, 1e-4)]), gpu_decode_curve=Curve.from_points([(1, 1e-4)]),
                          cpu_decode_grid=Grid((1.0,), (1.0,), ((1e-3,),)), head_curve=Curve.from_points([(1, 1e-3)]))
    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 10 * LAYER, kv_cache_bytes=GIB_BYTES)
    placement = plan_placement(inputs(budgets, link_s_per_layer=0.02))
    num_streamed = len(placement.streamed_layers)
    assert 0 < num_streamed < 16 and placement.pipeline == PIPELINE_PERFORMANCE
    cost = StreamingCostModel.for_placement(base, placement)
    share = 0.02 * num_streamed / 16
    assert cost.transfer_share_s == pytest.approx(share)
    assert cost.linear(1) == pytest.approx(max(0.002, share))  # transfer-bound: a bigger batch costs nothing more
    assert cost.linear(8) == cost.linear(1) and cost.linear(256) == pytest.approx(0.05)  # compute-bound again
    assert cost.linear_again(8) == base.linear(8) and cost.linear(0) == 0.0
    assert cost.head(4) == base.head(4) and cost.cpu_decode_attention(1, 10) == base.cpu_decode_attention(1, 10)
    serial = StreamingCostModel(base, share, overlapped=False)
    assert serial.linear(1) == pytest.approx(0.002 + share)


def test_measured_interference_between_loads_and_compute_slows_the_estimate():
    """Where a load and a compute share a memory bus (the host-only testbed), each measured slower
    beside the other: the replay slows each in proportion to their overlap; a resident placement
    overlaps nothing and is unchanged."""
    import dataclasses

    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 3 * LAYER, kv_cache_bytes=GIB_BYTES)
    base = inputs(budgets, mode="cpu", link_s_per_layer=0.005)  # compute-bound: loads overlap half of it
    slowed = dataclasses.replace(base, costs=dataclasses.replace(
        base.costs, linear_under_transfer=Curve.from_points([(1, 0.02), (64, 0.022)])),
        rates=dataclasses.replace(base.rates, link_bytes_per_s_under_compute=base.rates.link_bytes_per_s / 2))
    alone, together = plan_placement(base).estimate.timeline, plan_placement(slowed).estimate.timeline
    assert 0.06 < alone.overlap_s <= 16 * 0.005  # every load beside a compute, but those under the head
    assert together.iteration_s > alone.iteration_s * 1.3
    assert plan_placement(slowed).load_s[TIER_HOST] > plan_placement(base).load_s[TIER_HOST]
    resident = MemoryBudgets(kv_cache_bytes=GIB_BYTES)
    assert plan_placement(dataclasses.replace(slowed, budgets=resident, mode="gpu")).estimate.timeline.iteration_s == \
        pytest.approx(plan_placement(dataclasses.replace(base, budgets=resident, mode="gpu")).estimate.timeline.iteration_s)


def test_loads_and_compute_measured_faster_together_than_alone_count_as_alone():
    """A noisy probe (a busy neighbour while compute ran alone) must not make streaming look faster
    than keeping layers resident: the planner keeps as many layers resident as fit, and the
    estimate is the one measured alone."""
    import dataclasses

    budgets = MemoryBudgets(gpu_weight_bytes=GLOBALS + 8 * LAYER, kv_cache_bytes=GIB_BYTES)
    base = inputs(budgets, link_s_per_layer=0.005)
    noisy = dataclasses.replace(base, costs=dataclasses.replace(
        base.costs, linear_under_transfer=Curve.from_points([(1, 0.0025), (64, 0.00275)])),
        rates=dataclasses.replace(base.rates, link_bytes_per_s_under_compute=base.rates.link_bytes_per_s * 4))
    quiet, placed = plan_placement(base), plan_placement(noisy)
    assert placed.tiers == quiet.tiers and placed.num_layers_in(TIER_GPU) == quiet.num_layers_in(TIER_GPU) > 0
    assert placed.estimate.timeline.iteration_s == pytest.approx(quiet.estimate.timeline.iteration_s)
