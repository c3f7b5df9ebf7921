"""ScheInfer's MLP slicing (sec. III-B, III-C): each decoder layer's MLP cut along its intermediate
units into a part the CPU computes where it is stored (CC), a part stored in host memory and
streamed to the accelerator to be computed there (CG), and a part resident on the accelerator
(GG). The parts' outputs sum to the MLP's, as under tensor parallelism.

Units [0, cc) are CC's, [cc, cc + cg) CG's and the rest GG's: gate/up rows and the matching down
columns, cut on quantization-block boundaries where the format groups down's input dimension
(INT4: blocks of 32). The seam is the weight objects: `SlicedLayers` (a `LayerStore`) builds each
sliced layer's `gate_up` as a `SlicedGateUp` and its `down` as a `SlicedDown` over one shared
`SlicedMLP`, and the model's code (gate_up, silu(gate) * up, down) does not change.

Where the activation runs. The two weight objects could each slice their own matmul, with the
model's silu_mul over the whole intermediate between them; then CC's gate/up result would hop to
the accelerator for the activation and back for CC's down: two hops each way, and the CPU idle
while the accelerator finishes its gate/up. Instead `SlicedGateUp.apply` hands the CPU its whole
part of the MLP at once: the normed activations hop to the host once, the engine thread computes
CC's gate/up, silu(gate) * up and down there, and only CC's partial output [num_tokens, hidden]
hops back, summed into `SlicedDown`'s result. So `SlicedGateUp` returns the accelerator's units
only ([gate | up] of CG then GG), the model's silu_mul runs over those, and `SlicedDown` takes
them: one hop each way, and the CPU computes from the first matmul to the last while the
accelerator computes GG and CG (ScheInfer's fig. 5 timeline).

Execution: CC runs through the accelerator queue's `run_on_host` (engine/execution/queues.py: on
the testbed the accelerator thread hands it to the engine thread, which runs it while it waits;
on CUDA and inline the engine thread runs it after launching the accelerator's parts), with its
own thread count. CG's parts of a layer are one layer image streamed through `StreamedLayers`'
ring and transfer thread (PIPO's machinery, engine/execution/weight_stream.py): loaded while
earlier layers compute, acquired with the layer. Partial outputs are summed in one order (CG,
then GG, then CC's units), so results do not depend on which finished first. A layer the
placement streams whole (PIPO) is not sliced. A mixture-of-experts layer is sliced by whole
experts (`build_moe_layer`, engine/execution/moe_slicing.py; its CC experts take no moved rows).

Prefill token assignment (ScheInfer sec. IV-B, `MovedPart`). A `MovedTokens` policy given to the
store (scheduler/placement/moved_tokens.py; the engine's solves it per layer and token count from
the slicing models, --mlp-prefill-moving) says how many of a forward's rows CG' takes: as the MLP
starts, `SlicedGateUp` has a transfer thread of CG''s own copy CC's weights from their host image
into one accelerator buffer (the copy overlaps GG's and CG's compute), and hands the CPU the remaining
rows only (their hop to the host carries only those); `SlicedDown`, after CG's and GG's downs,
computes CC's units for the moved rows on the accelerator from the buffer and stacks them above
the CPU's rows. Where the accelerator is a host thread (device cpu, the testbed) the CPU's CC
weights are views into the very image that is copied; on CUDA a second host image in the
accelerator's format (pinned) is kept. Decode-sized forwards usually move nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future as CopyFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from engine.execution.cores import CoreAssignment
from engine.execution.queues import AcceleratorQueue, Future, InlineQueue
from engine.execution.transfer import CopyEngine, pin_to
from engine.execution.weight_stream import BUFFER_FORMAT, StreamedLayers, StreamLayout, create_transfer
from engine.model.config import ModelConfig
from engine.model.layers import fused_silu_mul
from engine.model.llama import LayerWeights, attention_linears, linear_maker
from engine.model.moe import MoeLayerWeights
from engine.quant import LinearMethod, LinearWeight
from engine.quant.int4 import DEFAULT_GROUP_SIZE, CpuInt4Kernels, KeepDense, PackedInt4, fuse
from engine.weights.layer_files import LayerFiles
from engine.weights.layer_image import LayerImage, meta_templates
from scheduler.placement import TIER_ACCELERATOR, TIER_HOST, WeightPlacement
from scheduler.placement.moved_tokens import MovedTokens
from scheduler.placement.slicing import NUM_CG_BUFFERS, SliceRates

if TYPE_CHECKING:
    from engine.execution.moe_slicing import SlicedSparseMoe

logger = logging.getLogger(__name__)

SLICES = ("cc", "cg", "gg")  # in unit order
MLP_NAMES = ("gate_up", "down")  # a slice's weights, in image order
MOVED_HOST_FORMAT = "CG' host copies"  # weight_bytes' format label for CC in the accelerator's format
HOST = torch.device("cpu")


# ---- cutting a loaded layer's MLP ---------------------------------------------------------------
def _rows(weight, start: int, end: int):
    """Output rows [start, end) of a loaded weight (a tensor, PackedInt4 or KeepDense)."""
    if isinstance(weight, PackedInt4):
        return PackedInt4(weight.qweight[start:end], weight.scales[start:end], weight.mins[start:end],
                          weight.group_size)
    if isinstance(weight, KeepDense):
        return KeepDense(weight.weight[start:end])
    return weight[start:end]


def _columns(weight, start: int, end: int):
    """Input columns [start, end) of a loaded weight; a packed one only on its groups' boundaries."""
    if isinstance(weight, PackedInt4):
        group = weight.group_size
        if start % group or end % group:
            raise ValueError(f"a packed INT4 weight is cut on its groups of {group} columns, not at "
                             f"[{start}, {end})")
        return PackedInt4(weight.qweight[:, start // 2:end // 2].contiguous(),
                          weight.scales[:, start // group:end // group].contiguous(),
                          weight.mins[:, start // group:end // group].contiguous(), group)
    if isinstance(weight, KeepDense):
        return KeepDense(weight.weight[:, start:end].contiguous())
    return weight[:, start:end].contiguous()


def slice_mlp(loaded: dict, counts: tuple[int, int, int]) -> dict[str, dict]:
    """A loaded layer's MLP cut into slices of `counts` (CC, CG, GG) intermediate units: for each
    slice with units, its fused gate/up rows ([gate | up], as LayerWeights fuses them) and down
    columns, as the linear methods take them."""
    slices, start = {}, 0
    for name, num_units in zip(SLICES, counts):
        end = start + num_units
        if num_units:
            gate_up = fuse([_rows(loaded["gate_proj"], start, end), _rows(loaded["up_proj"], start, end)])
            slices[name] = {"gate_up": gate_up, "down": _columns(loaded["down_proj"], start, end)}
        start = end
    return slices


# Dense slices are cut on multiples of this many units: the GEMMs' inner dimension (down's input)
# then stays a multiple of the kernels' blocking. Unaligned cuts (4126 and 2018 units of a 1B
# shape's 8192) decoded about 15% slower than aligned ones with more work on the slower side.
DENSE_SLICE_UNITS = 64


def unit_alignment(linear: LinearMethod) -> int:
    """The units a slice's size is a multiple of: INT4 groups down's input dimension; dense
    slices keep the GEMMs' blocking (DENSE_SLICE_UNITS)."""
    return getattr(linear, "group_size", DEFAULT_GROUP_SIZE) if linear.takes_packed_int4 else DENSE_SLICE_UNITS


# ---- the weight objects -----------------------------------------------------------------------
@dataclass
class SliceStats:
    """Running totals of the CPU's part since start (CG's transfers are the store's StreamStats)."""

    num_cc_calls: int = 0
    cc_s: float = 0.0  # CC's gate/up, activation and down, on the CPU
    cc_thread_ids: set[int] = field(default_factory=set)  # the threads that computed CC
    # Rows summed over dense layers: CC's units computed by the CPU, and by CG' on the accelerator instead
    num_cc_tokens: int = 0
    num_moved_tokens: int = 0
    moved_bytes: int = 0  # CC's weights copied to the accelerator for CG'
    moved_thread_ids: set[int] = field(default_factory=set)  # the threads that computed CG'
    moved_copy_thread_ids: set[int] = field(default_factory=set)  # the threads that copied CG''s weights


class HostSide:
    """How a sliced MLP reaches the CPU side: the accelerator queue the forward runs on (inline
    until the runner hands its own), and the threads CC's kernels use (None: the caller's)."""

    def __init__(self, num_threads: int | None) -> None:
        self.queue: AcceleratorQueue = InlineQueue()
        self.num_threads = num_threads

    def own_threads(self, weight: LinearWeight) -> LinearWeight:
        """`weight` (a CC part) with its INT4 kernels on the CPU part's threads; dense ones follow
        the calling thread's torch threads (`threads`)."""
        for part in weight.parts:
            kernels = getattr(part, "kernels", None)
            if self.num_threads is not None and isinstance(kernels, CpuInt4Kernels):
                kernels.num_threads = self.num_threads  # each weight has kernels of its own
        return weight

    @contextmanager
    def threads(self):
        """The CPU part's torch thread count (per thread under OpenMP), the caller's after."""
        before = torch.get_num_threads()
        if self.num_threads is not None and self.num_threads != before:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


class MovedPart:
    """CG' (ScheInfer sec. IV-B): CC's weights, stored on the host, copied into one accelerator
    buffer for the tokens a forward moves off the CPU (`MovedTokens` says how many per layer).

    The host bytes copies leave from: where the accelerator is a host thread (device cpu, the
    testbed) it computes from the CPU's format, so CC's weights are one host image per layer and
    the CPU part's weights are views into it (shared, no second copy; INT4 kernels are shared
    too, which is safe because the testbed refuses INT4 and device cpu has one thread pool).
    Elsewhere (CUDA: Triton's INT4 layout, pinned memory for asynchronous copies) a second host
    image in the accelerator's format is kept beside the CPU's weights.

    Copies go through the store's copy engine on a transfer thread of their own (a real memcpy on
    the host-side cores on the testbed; queued on the copy stream on CUDA), launched as the MLP
    starts so they overlap GG's and CG's compute; not on the ring's thread, whose next load may
    be waiting for this very layer's release. One buffer is enough: a CG' lives from its
    SlicedGateUp to the SlicedDown of the same sub-batch, and the accelerator runs a forward's
    MLPs (Neo's two sub-batches' too) one after the other, never interleaved, so the next copy
    is launched only once the last CG' was computed (on CUDA, queued: the copy waits for the event
    `done` records, as a ring load waits for its buffer's release)."""

    def __init__(self, policy: MovedTokens, copy_engine: CopyEngine, shares_host_bytes: bool,
                 stats: SliceStats) -> None:
        self.policy = policy
        self.copy_engine = copy_engine
        self.shares_host_bytes = shares_host_bytes
        self.stats = stats
        self._host: dict[int, tuple[LayerImage, dict[str, LinearWeight], torch.Tensor]] = {}
        self._bound: dict[int, dict[str, LinearWeight]] = {}  # each layer's weights in the buffer
        self._buffer: torch.Tensor | None = None  # uint8 [CC's largest image]
        self._state: dict = {}  # the copy engine's events for the buffer
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-moved-copy",
                                          initializer=pin_to(copy_engine.cores))

    def host_weights(self, layer: int, cpu_weights: dict[str, LinearWeight],
                     for_accelerator: Callable[[], dict[str, LinearWeight]]) -> dict[str, LinearWeight]:
        """Keep layer `layer`'s CC image for copies; -> the CPU part's weights (views into that
        image where the bytes are shared). `for_accelerator()` builds CC in the accelerator's format."""
        if self.shares_host_bytes:
            image, templates, data = self._host[layer] = host_image(cpu_weights, self.copy_engine.allocate_host)
            return image.bind(templates, data)
        self._host[layer] = host_image(for_accelerator(), self.copy_engine.allocate_host)
        return cpu_weights

    @property
    def largest_image_bytes(self) -> int:
        return max((image.nbytes for image, _, _ in self._host.values()), default=0)

    def start(self) -> None:
        """Allocate the buffer for CC's largest image, and bind each layer's weights in it."""
        if not self._host:
            return
        self._buffer = self.copy_engine.allocate_buffer(self.largest_image_bytes)
        self._bound = {layer: image.bind(templates, self._buffer)
                       for layer, (image, templates, _) in self._host.items()}

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        """The buffer, and the host images where they are not the CPU's weights, by (format, tier)."""
        host_bytes = 0 if self.shares_host_bytes else sum(image.nbytes for image, _, _ in self._host.values())
        extra = {(BUFFER_FORMAT, TIER_ACCELERATOR): self.buffer_bytes, (MOVED_HOST_FORMAT, TIER_HOST): host_bytes}
        return {key: nbytes for key, nbytes in extra.items() if nbytes}

    def count(self, layer: int, num_tokens: int) -> int:
        """The policy's count for these rows, checked."""
        count = self.policy.count(layer, num_tokens) if num_tokens else 0
        if not 0 <= count <= num_tokens:
            raise ValueError(f"{type(self.policy).__name__} moved {count} of layer {layer}'s {num_tokens} tokens")
        return count

    def load(self, layer: int) -> CopyFuture:
        """Start copying layer `layer`'s CC weights into the buffer."""
        return self._thread.submit(self._copy, layer)

    def _copy(self, layer: int) -> None:
        image, _, data = self._host[layer]
        self.copy_engine.before_load(self._state)
        self.copy_engine.copy(self._buffer[:image.nbytes], data[:image.nbytes])
        self.copy_engine.after_load(self._state)
        self.stats.moved_bytes += image.nbytes
        self.stats.moved_copy_thread_ids.add(threading.get_ident())

    def weights(self, layer: int, copy: CopyFuture) -> dict[str, LinearWeight]:
        """Layer `layer`'s CC weights in the buffer, once `copy` (its load) has landed."""
        copy.result()
        self.copy_engine.wait_loaded(self._state)
        return self._bound[layer]

    def done(self) -> None:
        """The CG' computed from the buffer is queued: the next copy may overwrite it after."""
        self.copy_engine.on_release(self._state)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@dataclass
class _CcCall:
    """CC's part of one MLP call in flight: the CPU's rows (the last ones) and CG''s (the first)."""

    on_cpu: Future | None = None  # -> [num_tokens - num_moved, hidden] on the host
    moved_x: torch.Tensor | None = None  # [num_moved, hidden], the rows CG' computes
    moved_copy: CopyFuture | None = None  # CC's weights on their way to the accelerator


class SlicedMLP:
    """One layer's MLP as slices: CC's weights on the host, CG's streamed (StreamedWeights), GG's
    resident; shared by the layer's SlicedGateUp and SlicedDown, which hand CC's output over.
    With `moved`, some of a forward's rows get CC's units from CG' on the accelerator instead."""

    def __init__(self, layer: int, slices: dict[str, dict[str, LinearWeight]], counts: tuple[int, int, int],
                 host: HostSide, stats: SliceStats, moved: MovedPart | None = None) -> None:
        self.layer = layer
        self.slices = slices  # "cc" / "cg" / "gg" -> {"gate_up": ..., "down": ...}, slices with units only
        self.counts = dict(zip(SLICES, counts))
        self.host = host
        self.stats = stats
        self.moved = moved
        self.pending_cc: _CcCall | None = None  # CC's part of the gate_up applied last

    @property
    def accelerator_slices(self) -> list[str]:
        return [name for name in ("cg", "gg") if name in self.slices]

    def start_cc(self, x: torch.Tensor) -> None:
        """Hand CC's part of x [num_tokens, hidden] over: the first rows the policy moves go to CG'
        (their weights' copy launched first, so the link starts at once), the rest to the CPU."""
        if "cc" not in self.slices:
            return
        num_moved = 0 if self.moved is None else self.moved.count(self.layer, x.shape[0])
        call = self.pending_cc = _CcCall()
        if num_moved:
            call.moved_copy, call.moved_x = self.moved.load(self.layer), x[:num_moved]
        if not num_moved == x.shape[0] > 0:  # rows left, or none at all (an empty sub-batch: [0, hidden])
            call.on_cpu = self._start_on_cpu(x[num_moved:])

    def _start_on_cpu(self, x: torch.Tensor) -> Future:
        """The CPU's whole part at once: x's hop to the host, CC's gate/up, activation and down."""
        queue = self.host.queue
        x_host = queue.copy_to_host(x)
        return queue.run_on_host(lambda: self._compute_cc(x_host))

    def _compute_cc(self, x_host: Future) -> torch.Tensor:
        start = time.perf_counter()
        weights = self.slices["cc"]
        x = x_host.result()  # [num_cpu_tokens, hidden] on the host
        with self.host.threads():
            out = weights["down"].apply(fused_silu_mul(weights["gate_up"].apply(x)))
        self.stats.num_cc_calls += 1
        self.stats.num_cc_tokens += x.shape[0]
        self.stats.cc_s += time.perf_counter() - start
        self.stats.cc_thread_ids.add(threading.get_ident())
        return out  # [num_cpu_tokens, hidden]

    def _compute_moved(self, call: _CcCall) -> torch.Tensor:
        """CG': CC's units for the moved rows, on the accelerator from the copied weights."""
        weights = self.moved.weights(self.layer, call.moved_copy)
        out = weights["down"].apply(fused_silu_mul(weights["gate_up"].apply(call.moved_x)))
        self.moved.done()
        self.stats.num_moved_tokens += call.moved_x.shape[0]
        self.stats.moved_thread_ids.add(threading.get_ident())
        return out  # [num_moved, hidden]

    def take_cc(self, device: torch.device) -> torch.Tensor | None:
        """CC's units' output for the down being applied, [num_tokens, hidden] on `device`: CG''s
        rows computed now, then the CPU's (waited for); None without CC."""
        if "cc" not in self.slices:
            return None
        if self.pending_cc is None:
            raise RuntimeError(f"layer {self.layer}'s sliced down was applied before its gate_up")
        call, self.pending_cc = self.pending_cc, None
        outputs = []
        if call.moved_copy is not None:
            outputs.append(self._compute_moved(call))
        if call.on_cpu is not None:
            outputs.append(call.on_cpu.result().to(device, non_blocking=True))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def parts(self, name: str) -> list[tuple[LinearWeight, str]]:
        """The `name` weights (gate_up or down) of every slice, each with its tier."""
        placed = []
        for slice_name, weights in self.slices.items():
            tier = TIER_HOST if slice_name == "cc" else weights[name].tier
            placed += [(part, tier) for part, _ in weights[name].placed_parts()]
        return placed


class _SlicedWeight(LinearWeight):
    """What SlicedGateUp and SlicedDown report alike: their parts in several tiers."""

    method = "sliced"
    name: str  # the MLP weight it is: gate_up or down

    def __init__(self, mlp: SlicedMLP) -> None:
        self.mlp = mlp

    @property
    def parts(self) -> tuple[LinearWeight, ...]:
        return tuple(part for part, _ in self.mlp.parts(self.name))

    def placed_parts(self) -> tuple[tuple[LinearWeight, str], ...]:
        return tuple(self.mlp.parts(self.name))

    @property
    def format(self) -> str:
        return "+".join(dict.fromkeys(part.format for part in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def tensors(self) -> dict[str, torch.Tensor]:
        # CG's tensors live in the streamed image; these are the CPU's and the resident ones
        return {f"{slice_name}.{key}": t for slice_name, weights in self.mlp.slices.items() if slice_name != "cg"
                for key, t in weights[self.name].tensors().items()}

    def with_tensors(self, tensors):
        raise TypeError("a sliced MLP weight is not rebound to other memory: its slices live in different tiers")


class SlicedGateUp(_SlicedWeight):
    """gate/up of a sliced MLP: starts the CPU's part, returns the accelerator's units,
    [num_tokens, 2 * (cg + gg)] as [gate | up], CG's units before GG's."""

    name = "gate_up"

    def __init__(self, mlp: SlicedMLP, hidden_size: int) -> None:
        super().__init__(mlp)
        self.in_features = hidden_size
        self.out_features = 2 * (mlp.counts["cg"] + mlp.counts["gg"])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        self.mlp.start_cc(x)
        outputs = [self.mlp.slices[name]["gate_up"].apply(x) for name in self.mlp.accelerator_slices]
        if not outputs:
            return x.new_empty(x.shape[0], 0)
        if len(outputs) == 1:
            return outputs[0]
        gates, ups = zip(*(out.chunk(2, dim=-1) for out in outputs))
        return torch.cat([*gates, *ups], dim=-1)


class SlicedDown(_SlicedWeight):
    """down of a sliced MLP: the accelerator's slices over their units of the activation, plus
    CC's units' output (CG''s rows, then the CPU's), summed CG, GG, CC. -> [num_tokens, hidden]"""

    name = "down"

    def __init__(self, mlp: SlicedMLP, hidden_size: int) -> None:
        super().__init__(mlp)
        self.in_features = mlp.counts["cg"] + mlp.counts["gg"]
        self.out_features = hidden_size

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        out, start = None, 0
        for name in self.mlp.accelerator_slices:
            end = start + self.mlp.counts[name]
            partial = self.mlp.slices[name]["down"].apply(x[:, start:end].contiguous())
            out = partial if out is None else out + partial
            start = end
        cc = self.mlp.take_cc(x.device)
        if cc is not None:
            out = cc if out is None else out + cc
        return out


# ---- the store ----------------------------------------------------------------------------------
class SlicedLayers(StreamedLayers):
    """Decoder layers whose MLPs are sliced at each layer's rates; attention and GG resident, CC
    in host memory, CG streamed through the ring; with `moved_tokens`, a forward's tokens it
    names get CC's units from CG' (MovedPart). Layers the layout streams whole are streamed as
    StreamedLayers streams them."""

    def __init__(self, rates: Sequence[SliceRates], layout: StreamLayout, device: torch.device, copy_engine,
                 num_cc_threads: int | None, moved_tokens: MovedTokens | None = None, **stream_options) -> None:
        if len(rates) != len(layout.tiers):
            raise ValueError(f"slice rates for {len(rates)} layers, but the model has {len(layout.tiers)}")
        super().__init__(layout, device, copy_engine, **stream_options)
        self.rates = tuple(rates)
        self.host = HostSide(num_cc_threads)
        self.slice_stats = SliceStats()
        self.mlps: dict[int, SlicedMLP] = {}  # the sliced layers' MLPs
        self.moe_layers: dict[int, SlicedSparseMoe] = {}  # MoE layers with experts off the accelerator
        self.moved = None if moved_tokens is None else MovedPart(
            moved_tokens, copy_engine, torch.device(device).type == HOST.type, self.slice_stats)

    def use_accelerator(self, accelerator: AcceleratorQueue) -> None:
        self.host.queue = accelerator

    def build(self, index: int, loaded: dict, linear: LinearMethod, dtype: torch.dtype) -> LayerWeights:
        rates = self.rates[index]
        if self.tiers[index] != TIER_ACCELERATOR or rates == SliceRates.resident():
            return super().build(index, loaded, linear, dtype)
        counts = rates.counts(loaded["gate_proj"].shape[0], unit_alignment(linear))
        cut = slice_mlp(loaded, counts)

        for_accelerator = linear_maker(linear, dtype, HOST, self.device)  # built on the host, copied over
        resident = attention_linears(loaded, for_accelerator)
        resident.update({f"gg.{name}": for_accelerator(w) for name, w in cut.get("gg", {}).items()})
        weights = self.place_resident(*host_image(resident, self.copy_engine.allocate_host))
        slices = {}
        if "cc" in cut:
            slices["cc"] = self._cc_weights(index, cut["cc"], linear, dtype)
        if "cg" in cut:
            streamed = {name: for_accelerator(w) for name, w in cut["cg"].items()}
            slices["cg"] = self.place_streamed(index, TIER_HOST, *host_image(streamed, self.copy_engine.allocate_host))
        if "gg" in cut:
            slices["gg"] = {name: weights[f"gg.{name}"] for name in MLP_NAMES}
        mlp = self.mlps[index] = SlicedMLP(index, slices, counts, self.host, self.slice_stats, self.moved)
        hidden_size = weights["o_proj"].out_features
        return LayerWeights(input_norm=loaded["input_layernorm"].to(self.device), qkv=weights["qkv"],
                            o_proj=weights["o_proj"], post_norm=loaded["post_attention_layernorm"].to(self.device),
                            gate_up=SlicedGateUp(mlp, hidden_size), down=SlicedDown(mlp, hidden_size))

    def build_moe_layer(self, index: int, loaded: dict, config: ModelConfig, linear: LinearMethod,
                        dtype: torch.dtype) -> MoeLayerWeights:
        """A mixture-of-experts layer with whole experts in the tiers (engine/execution/moe_slicing.py);
        a MoE model's dense layers sliced as `build` slices them."""
        from engine.execution.moe_slicing import build_sliced_moe_layer  # it builds on this module
        return build_sliced_moe_layer(self, index, loaded, config, linear, dtype)

    def _cc_weights(self, index: int, cut: dict, linear: LinearMethod, dtype: torch.dtype) -> dict[str, LinearWeight]:
        """CC's weights for the CPU, on its threads; with CG' on, their image kept for its copies."""
        on_host = {name: linear_maker(linear, dtype, HOST, HOST)(w) for name, w in cut.items()}
        if self.moved is not None:
            for_accelerator = linear_maker(linear, dtype, HOST, self.device)
            on_host = self.moved.host_weights(index, on_host, lambda: {name: for_accelerator(w)
                                                                       for name, w in cut.items()})
        return {name: self.host.own_threads(w) for name, w in on_host.items()}

    def start(self) -> None:
        """The ring (StreamedLayers.start), then CG''s buffer where the weight budget has room for
        it beside the ring (the slicing planner keeps room for it); where it has not, every token's
        CC stays on the CPU, as logged."""
        super().start()
        if self.moved is None:
            return
        ring_bytes = sum(buffer.data.numel() for buffer in self._buffers)
        room_bytes = None if self.budget_bytes is None else self.budget_bytes - self.used_bytes - ring_bytes
        if room_bytes is not None and self.moved.largest_image_bytes > room_bytes:
            logger.warning("prefill token assignment off: CG''s buffer of %.1f MiB does not fit in --weights-gpu-gib "
                           "beside the other weights and buffers (%.1f MiB left); the CPU computes CC for every token",
                           self.moved.largest_image_bytes / 2**20, room_bytes / 2**20)
            self._stop_moving()
            return
        self.moved.start()
        self.used_bytes += self.moved.buffer_bytes

    def _stop_moving(self) -> None:
        self.moved.close()
        self.moved = None
        for mlp in self.mlps.values():
            mlp.moved = None

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        totals = super().extra_weight_bytes()
        for key, nbytes in (self.moved.extra_weight_bytes() if self.moved is not None else {}).items():
            totals[key] = totals.get(key, 0) + nbytes
        return totals

    def mlp_cpu_s(self) -> float | None:
        return self.slice_stats.cc_s if self.mlps or self.moe_layers else None

    def mlp_moved_tokens(self) -> int | None:
        return self.slice_stats.num_moved_tokens if self.moved is not None and self.mlps else None

    def recover(self) -> None:
        super().recover()
        for mlp in self.mlps.values():
            mlp.pending_cc = None

    def close(self) -> None:
        if self.moved is not None:
            self.moved.close()
        super().close()


def host_image(linears: dict[str, LinearWeight], allocate) -> tuple[LayerImage, dict[str, LinearWeight], torch.Tensor]:
    """The weights' image written into a host buffer from `allocate(nbytes)`: (image, meta
    templates, bytes)."""
    image = LayerImage.of(linears)
    data = allocate(image.nbytes)
    image.write(linears, data)
    return image, meta_templates(linears), data


def slicing_layout(num_layers: int, placement: WeightPlacement | None) -> StreamLayout:
    """The placement's layout (layers it streams whole stay streamed), with room in the ring for
    CG's parts; every layer resident without a placement."""
    if placement is None:
        return StreamLayout((TIER_ACCELERATOR,) * num_layers, NUM_CG_BUFFERS, 0)
    layout = StreamLayout.of(placement)
    return StreamLayout(layout.tiers, max(layout.num_buffers, NUM_CG_BUFFERS), layout.buffer_bytes)


def create_sliced_layer_store(rates: Sequence[SliceRates], placement: WeightPlacement | None,
                              device: torch.device, cores: CoreAssignment, files: LayerFiles | None = None,
                              num_io_threads: int = 1, accelerator_weight_budget_bytes: int | None = None,
                              global_weight_bytes: int = 0, moved_tokens: MovedTokens | None = None) -> SlicedLayers:
    """The store slicing each layer's MLP at `rates` (one per layer), composed with `placement`'s
    whole-layer streaming where there is one: transfer threads on the host-side cores, CC on the
    CPU side's threads (the caller's own on device cpu, where one pool serves both sides); CG'
    for the tokens `moved_tokens` names (None: the CPU computes CC for every token)."""
    layout = slicing_layout(len(rates), placement)
    engine, reader = create_transfer(layout, device, cores, num_io_threads)
    num_cc_threads = None if cores.device == "cpu" else cores.cpu_attention_threads
    return SlicedLayers(rates, layout, device, engine, num_cc_threads, moved_tokens, files=files, reader=reader,
                        accelerator_weight_budget_bytes=accelerator_weight_budget_bytes,
                        global_weight_bytes=global_weight_bytes)
