"""Nodes joined by a network link: tensor parallelism and pipeline stages in simulated time.

One GPU per node. A `Link` prices what crosses it: a message costs the wire's one-way latency, a
fixed software cost per call (the collective library's or channel's own work and the wake-ups it
takes), and its bytes at the link's rate. Two cost models wrap one node's costs (a roofline or a
profile of one rank holding the whole model), so `simulate` drives the real scheduler over them:

    TensorParallelCostModel   every stage split over the ranks (ideally), plus two ring all-reduces
                              of the activations per layer and an all-gather of the LM head's logits
    PipelineCostModel         each stage runs its contiguous layers in turn (no micro-batches, as
                              the engine's stages do), plus one activation send per stage boundary

The per-iteration messages are charged to the layers' linear stage in equal shares, so the
scheduler's own estimate (which multiplies a layer by num_layers) sees them too. A node whose share
of the weights does not fit streams the rest from host memory under the layers it computes
(PIPO's pipeline, `StreamingCostModel`). No torch here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from scheduler.planning.cost_model import CostModel, ModelShape
from scheduler.planning.offload_cost import StreamingCostModel, WrappedCostModel
from scheduler.simulation.roofline import (GIB, GPU_MEMORY_UTILIZATION, LOGITS_BYTES, NUM_ALLREDUCES_PER_LAYER,
                                           HardwareProfile, RooflineCostModel, activation_bytes_per_gpu,
                                           weight_bytes)
from scheduler.neo import NeoConfig, NeoKnobs, NeoScheduler
from scheduler.scheduler import SchedulerConfig
from scheduler.simulation.simulator import MIN_NUM_BATCHED_TOKENS, SimulationResult, Workload, simulate

BITS_PER_BYTE = 8
BLOCK_SIZE = 16  # tokens per KV block, as the engine's default


@dataclass(frozen=True)
class Link:
    """One direction of a node-to-node link."""

    name: str
    bandwidth_gbit_s: float  # payload rate (Gbit/s, 1e9 bits)
    latency_s: float  # one way, on the wire
    call_s: float  # software cost of one message or collective step beyond the wire

    def __post_init__(self) -> None:
        for name in ("bandwidth_gbit_s", "latency_s", "call_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0 or (name == "bandwidth_gbit_s" and value == 0):
                raise ValueError(f"link {self.name!r}: {name} must be a number >= 0 (bandwidth > 0), got {value!r}")

    def wire_s(self, nbytes: float) -> float:
        return nbytes * BITS_PER_BYTE / (self.bandwidth_gbit_s * 1e9)

    def send_s(self, nbytes: float) -> float:
        """One message from one node to the next."""
        return self.latency_s + self.call_s + self.wire_s(nbytes)

    def allreduce_s(self, nbytes: float, num_ranks: int) -> float:
        """A ring all-reduce of `nbytes` on each rank: 2 (g - 1) steps, each passing 1/g of it."""
        if num_ranks <= 1:
            return 0.0
        steps = 2 * (num_ranks - 1)
        return steps * (self.latency_s + self.call_s + self.wire_s(nbytes / num_ranks))

    def allgather_s(self, nbytes: float, num_ranks: int) -> float:
        """A ring all-gather of shards that add up to `nbytes`: g - 1 steps of one shard each."""
        if num_ranks <= 1:
            return 0.0
        return (num_ranks - 1) * (self.latency_s + self.call_s + self.wire_s(nbytes / num_ranks))

    @classmethod
    def from_allreduce(cls, name: str, bandwidth_gbit_s: float, round_trip_s: float, allreduce_s: float,
                       allreduce_bytes: float) -> "Link":
        """A link whose per-call cost is what a measured 2-rank all-reduce of `allreduce_bytes`
        took beyond its wire time."""
        probe = cls(name, bandwidth_gbit_s, round_trip_s / 2, 0.0)
        call_s = max(0.0, allreduce_s - probe.allreduce_s(allreduce_bytes, 2)) / 2
        return cls(name, bandwidth_gbit_s, round_trip_s / 2, call_s)


@dataclass(frozen=True)
class Layout:
    """How a model spreads over nodes: `tensor_parallel` ranks per stage, `pipeline_parallel`
    stages; one node (one GPU) per rank."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def num_nodes(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def describe(self) -> str:
        return f"tp {self.tensor_parallel} x pp {self.pipeline_parallel}"


class TensorParallelCostModel(WrappedCostModel):
    """`base` (one rank holding the whole model) split over `num_ranks` ranks on `link`. Every
    stage's time divides by the ranks, which is exact for the roofs and optimistic for fixed costs;
    each layer adds its all-reduces of `activation_bytes` per token, and each iteration the gather
    of the LM head's fp32 logit shards."""

    def __init__(self, base: CostModel, num_ranks: int, link: Link, shape: ModelShape, activation_bytes: int) -> None:
        super().__init__(base)
        self.num_ranks, self.link = num_ranks, link
        self.hidden_size, self.vocab_size, self.activation_bytes = shape.hidden_size, shape.vocab_size, activation_bytes

    def _allreduces_s(self, num_tokens: int) -> float:
        nbytes = num_tokens * self.hidden_size * self.activation_bytes
        return NUM_ALLREDUCES_PER_LAYER * self.link.allreduce_s(nbytes, self.num_ranks)

    def linear(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.base.linear(num_tokens) / self.num_ranks + self._allreduces_s(num_tokens)

    def linear_again(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.base.linear_again(num_tokens) / self.num_ranks + self._allreduces_s(num_tokens)

    def cpu_linear(self, num_tokens: int) -> float:
        return self.base.cpu_linear(num_tokens) / self.num_ranks

    def prefill_attention(self, seq_lens: Sequence[int]) -> float:
        return self.base.prefill_attention(seq_lens) / self.num_ranks

    def gpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        return self.base.gpu_decode_attention(num_seqs, context_tokens) / self.num_ranks

    def cpu_decode_attention(self, num_seqs: int, context_tokens: int) -> float:
        # each node's host attends its own ranks' heads
        return self.base.cpu_decode_attention(num_seqs, context_tokens) / self.num_ranks

    def head(self, num_seqs: int) -> float:
        if num_seqs <= 0:
            return 0.0
        logits_bytes = num_seqs * self.vocab_size * LOGITS_BYTES
        return self.base.head(num_seqs) / self.num_ranks + self.link.allgather_s(logits_bytes, self.num_ranks)

    def swap(self, num_blocks: int) -> float:
        return self.base.swap(num_blocks) / self.num_ranks


class PipelineCostModel(WrappedCostModel):
    """`base`'s layers cut into `num_stages` contiguous stages on nodes joined by `link`, run in
    turn: an iteration is every layer's time, as on one node, plus a send of the step's
    activations at each of the num_stages - 1 boundaries, charged to the layers in equal shares."""

    def __init__(self, base: CostModel, num_stages: int, link: Link, shape: ModelShape, activation_bytes: int) -> None:
        super().__init__(base)
        self.num_stages, self.link = num_stages, link
        self.hidden_size, self.activation_bytes = shape.hidden_size, activation_bytes

    def _sends_share_s(self, num_tokens: int) -> float:
        sends_s = (self.num_stages - 1) * self.link.send_s(num_tokens * self.hidden_size * self.activation_bytes)
        return sends_s / self.num_layers

    def linear(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.base.linear(num_tokens) + self._sends_share_s(num_tokens)

    def linear_again(self, num_tokens: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return self.base.linear_again(num_tokens) + self._sends_share_s(num_tokens)


def spread(base: CostModel, layout: Layout, link: Link, shape: ModelShape, activation_bytes: int = 2) -> CostModel:
    """`base` (one node holding the whole model) spread over `layout`'s nodes on `link`."""
    cost = base
    if layout.tensor_parallel > 1:
        cost = TensorParallelCostModel(cost, layout.tensor_parallel, link, shape, activation_bytes)
    if layout.pipeline_parallel > 1:
        cost = PipelineCostModel(cost, layout.pipeline_parallel, link, shape, activation_bytes)
    return cost


# ---- one model on a cluster of one-GPU nodes -----------------------------------------------------
@dataclass(frozen=True)
class NodeMemory:
    """One node's GPU memory under a layout: its share of the weights and the KV the workload
    needs resident, and the weight bytes that stream from host memory because they do not fit."""

    weight_gib: float
    kv_gib: float
    streamed_gib: float

    @property
    def fits(self) -> bool:
        return self.streamed_gib == 0


def node_memory(shape: ModelShape, node: HardwareProfile, layout: Layout, workload: Workload, *,
                dtype_bytes: int = 2, weight_element_bytes: float | None = None,
                kv_element_bytes: float | None = None) -> NodeMemory:
    """Each node keeps 1 / num_nodes of the weights and of every token's KV (the layers or heads
    it holds), room for all of the workload's requests at full length, and its activations; what
    is left over of its weights streams."""
    num_nodes = layout.num_nodes
    weights = weight_bytes(shape, dtype_bytes, weight_element_bytes) / num_nodes
    max_tokens = workload.num_requests * (workload.max_input_len + workload.max_output_len)
    kv = max_tokens * shape.num_layers * shape.kv_bytes_per_token_layer(kv_element_bytes or dtype_bytes) / num_nodes
    activations = activation_bytes_per_gpu(shape, layout.tensor_parallel, dtype_bytes,
                                           workload.max_input_len, workload.num_requests)
    usable = node.gpu_memory_gib * GIB * GPU_MEMORY_UTILIZATION - activations - kv
    if usable <= 0:
        raise ValueError(f"{node.name}: the workload's KV ({kv / GIB:.1f} GiB a node) leaves no room for weights "
                         f"under {layout.describe()}")
    return NodeMemory(weights / GIB, kv / GIB, max(0.0, weights - usable) / GIB)


def simulate_cluster(shape: ModelShape, node: HardwareProfile, layout: Layout, link: Link, workload: Workload, *,
                     dtype_bytes: int = 2, weight_element_bytes: float | None = None,
                     kv_element_bytes: float | None = None) -> tuple[SimulationResult, NodeMemory]:
    """`workload` on `layout.num_nodes` nodes, each one `node` with its one GPU, GPU-only (no CPU
    attention): each node's roofline, spread over the layout, its overflow streamed over PCIe."""
    memory = node_memory(shape, node, layout, workload, dtype_bytes=dtype_bytes,
                         weight_element_bytes=weight_element_bytes, kv_element_bytes=kv_element_bytes)
    single = replace(node, num_gpus=1, interconnect_gbps=0.0)
    cost: CostModel = RooflineCostModel(shape, single, dtype_bytes, kv_element_bytes=kv_element_bytes,
                                        weight_element_bytes=weight_element_bytes)
    if not memory.fits:  # each node loads its streamed bytes once per iteration, under its layers
        load_s = memory.streamed_gib * GIB / node.pcie_bandwidth
        layers_per_node = shape.num_layers / layout.pipeline_parallel
        cost = StreamingCostModel(cost, load_s / layers_per_node * layout.tensor_parallel, overlapped=True)
    return simulate_costs(spread(cost, layout, link, shape, dtype_bytes), workload), memory


def simulate_costs(cost: CostModel, workload: Workload) -> SimulationResult:
    """`workload` under `cost` on one GPU pool with room for every request at full length (each
    ending in a partial block), no host pool: the scheduler as a cluster's driver runs it."""
    max_model_len = workload.max_input_len + workload.max_output_len
    num_blocks = workload.num_requests * (math.ceil(max_model_len / BLOCK_SIZE) + 1)
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                             max_num_seqs=max(workload.num_requests, 1),
                             max_num_batched_tokens=max(max_model_len, MIN_NUM_BATCHED_TOKENS),
                             enable_prefix_caching=False)
    return simulate(NeoScheduler(config, NeoConfig.from_knobs(NeoKnobs(), 0), cost), workload)
