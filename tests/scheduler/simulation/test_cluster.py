"""Nodes joined by a link in simulated time: the link's prices, tensor parallelism's and pipeline
stages' cost models over one node's, and whole runs of the scheduler over them. No torch."""
import subprocess
import sys

import pytest

from engine.model_config import load_model_preset
from scheduler.simulation.cluster import (Layout, Link, PipelineCostModel, TensorParallelCostModel, node_memory,
                                          simulate_cluster, simulate_costs, spread)
from scheduler.simulation.roofline import LOGITS_BYTES, HardwareProfile, RooflineCostModel, weight_bytes
from scheduler.simulation.simulator import Workload

SHAPE, DTYPE_BYTES = load_model_preset("llama-3.1-70b")
NODE = HardwareProfile.load("a10g-g5.4xlarge")
INT4_BYTES = 0.75
GBE = Link("1 GbE", 0.94, 50e-6, 25e-6)
FREE = Link("free", 1e9, 0.0, 0.0)  # nothing crossing it costs anything


def one_node():
    return RooflineCostModel(SHAPE, NODE, DTYPE_BYTES, weight_element_bytes=INT4_BYTES)


def test_cluster_model_does_not_import_torch():
    code = "import sys, scheduler.simulation.cluster; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- the link ----------------------------------------------------------------------------------
def test_a_message_costs_latency_call_and_wire():
    assert GBE.send_s(1e6) == pytest.approx(50e-6 + 25e-6 + 8e6 / 0.94e9)


def test_ring_collectives_count_their_steps():
    nbytes = 1 << 20
    step = GBE.latency_s + GBE.call_s
    assert GBE.allreduce_s(nbytes, 1) == GBE.allgather_s(nbytes, 1) == 0.0
    assert GBE.allreduce_s(nbytes, 2) == pytest.approx(2 * (step + GBE.wire_s(nbytes / 2)))
    assert GBE.allreduce_s(nbytes, 4) == pytest.approx(6 * (step + GBE.wire_s(nbytes / 4)))
    assert GBE.allgather_s(nbytes, 4) == pytest.approx(3 * (step + GBE.wire_s(nbytes / 4)))


def test_a_link_from_a_measured_allreduce_gives_it_back():
    link = Link.from_allreduce("probe", 0.9, round_trip_s=60e-6, allreduce_s=0.9e-3, allreduce_bytes=4608)
    assert link.latency_s == pytest.approx(30e-6)
    assert link.allreduce_s(4608, 2) == pytest.approx(0.9e-3)
    assert Link.from_allreduce("fast", 0.9, 60e-6, 1e-9, 4608).call_s == 0.0  # never below the wire


@pytest.mark.parametrize("field, value", [("bandwidth_gbit_s", 0), ("latency_s", -1e-6), ("call_s", float("nan")),
                                          ("call_s", True)])
def test_bad_link_values_are_refused_by_name(field, value):
    fields = {"name": "bad", "bandwidth_gbit_s": 1.0, "latency_s": 0.0, "call_s": 0.0, field: value}
    with pytest.raises(ValueError, match=field):
        Link(**fields)


@pytest.mark.parametrize("tp, pp", [(0, 1), (1, 0), (1.5, 1)])
def test_bad_layouts_are_refused(tp, pp):
    with pytest.raises(ValueError):
        Layout(tp, pp)


# ---- the cost models -----------------------------------------------------------------------------
def test_tensor_parallel_splits_every_stage_and_adds_its_collectives():
    base = one_node()
    tp = TensorParallelCostModel(base, 2, GBE, SHAPE, DTYPE_BYTES)
    allreduce = GBE.allreduce_s(8 * SHAPE.hidden_size * DTYPE_BYTES, 2)
    assert tp.linear(8) == pytest.approx(base.linear(8) / 2 + 2 * allreduce)
    assert tp.gpu_decode_attention(8, 4000) == pytest.approx(base.gpu_decode_attention(8, 4000) / 2)
    assert tp.head(8) == pytest.approx(base.head(8) / 2 + GBE.allgather_s(8 * SHAPE.vocab_size * LOGITS_BYTES, 2))
    assert tp.linear(0) == tp.head(0) == 0.0
    free = TensorParallelCostModel(base, 4, FREE, SHAPE, DTYPE_BYTES)
    assert free.linear(8) == pytest.approx(base.linear(8) / 4)


def test_pipeline_stages_add_one_send_per_boundary_to_an_iteration():
    base = one_node()
    pp = PipelineCostModel(base, 3, GBE, SHAPE, DTYPE_BYTES)
    send = GBE.send_s(8 * SHAPE.hidden_size * DTYPE_BYTES)
    assert SHAPE.num_layers * pp.linear(8) == pytest.approx(SHAPE.num_layers * base.linear(8) + 2 * send)
    assert pp.gpu_decode_attention(8, 4000) == base.gpu_decode_attention(8, 4000)
    assert pp.head(8) == base.head(8)


def test_spread_composes_tensor_parallel_stages():
    cost = spread(one_node(), Layout(2, 2), GBE, SHAPE, DTYPE_BYTES)
    assert isinstance(cost, PipelineCostModel) and isinstance(cost.base, TensorParallelCostModel)
    assert type(spread(one_node(), Layout(), GBE, SHAPE)) is RooflineCostModel


# ---- whole runs ------------------------------------------------------------------------------------
def simulate(layout, link, num_requests=32):
    return simulate_cluster(SHAPE, NODE, layout, link, Workload(num_requests, 128, 64), dtype_bytes=DTYPE_BYTES,
                            weight_element_bytes=INT4_BYTES)


def test_int4_weights_are_counted_at_their_stored_size():
    assert weight_bytes(SHAPE, 2, INT4_BYTES) < 0.4 * weight_bytes(SHAPE, 2)
    half = RooflineCostModel(SHAPE, NODE, DTYPE_BYTES, weight_element_bytes=1)
    assert half.linear(1) < one_node().linear(1) * 1.4 < RooflineCostModel(SHAPE, NODE, DTYPE_BYTES).linear(1)


def test_what_does_not_fit_a_node_streams():
    workload = Workload(32, 128, 64)
    two = node_memory(SHAPE, NODE, Layout(1, 2), workload, dtype_bytes=DTYPE_BYTES, weight_element_bytes=INT4_BYTES)
    four = node_memory(SHAPE, NODE, Layout(2, 2), workload, dtype_bytes=DTYPE_BYTES, weight_element_bytes=INT4_BYTES)
    assert not two.fits and two.streamed_gib > 1
    assert four.fits and four.weight_gib == pytest.approx(two.weight_gib / 2)
    streamed, _ = simulate(Layout(1, 2), FREE)
    resident, _ = simulate(Layout(1, 4), FREE)
    assert streamed.output_throughput < 0.8 * resident.output_throughput


def test_a_free_link_makes_stages_in_turn_as_fast_as_one_node():
    workload = Workload(8, 128, 32)
    alone = simulate_costs(one_node(), workload)
    staged = simulate_costs(spread(one_node(), Layout(1, 4), FREE, SHAPE), workload)
    assert staged.output_throughput == pytest.approx(alone.output_throughput, rel=1e-6)


def test_slow_ethernet_favours_stages_and_a_free_link_tensor_parallelism():
    tp_slow, _ = simulate(Layout(4, 1), GBE)
    pp_slow, _ = simulate(Layout(1, 4), GBE)
    assert pp_slow.output_throughput > 3 * tp_slow.output_throughput
    tp_free, _ = simulate(Layout(4, 1), FREE)
    pp_free, _ = simulate(Layout(1, 4), FREE)
    assert tp_free.output_throughput > 1.5 * pp_free.output_throughput


def test_the_scheduler_estimates_what_the_cluster_clock_charges():
    result, _ = simulate(Layout(2, 2), GBE, num_requests=8)
    assert result.num_estimate_mismatches == 0
    assert result.num_output_tokens == sum(output for _, _, output in Workload(8, 128, 64).sample())
