"""ScheInfer's MLP slicing (sec. III-B, III-C): a decoder layer's MLP cut along its intermediate
units into a part the CPU computes where it is stored (CC), a part stored in host memory and
streamed to the GPU to be computed there (CG), and a part resident on the GPU
(GG). The parts' outputs sum to the MLP's, as under tensor parallelism.

Units [0, cc) are CC's, [cc, cc + cg) CG's and the rest GG's: gate/up rows and the matching down
columns, cut on quantization-block boundaries where the format groups down's input dimension
(INT4: blocks of 32). `SlicedMlp` is the layer's MLP, one part with one `apply`.

The CPU gets its whole part at once: the normed activations hop to the host once, the CPU side
computes CC's gate/up, silu(gate) * up and down there, and only CC's output [num_tokens, hidden]
hops back; meanwhile the GPU computes CG (from the ring, engine/offload/ring.py) and
GG (ScheInfer's fig. 5 timeline). Partial outputs are summed in one order (CG, GG, then CC), so
results do not depend on which side finished first. With a `MovedPart` (CG'), the first rows a
forward moves get CC's units on the GPU instead (engine/offload/slicing/moved_part.py).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future as CopyFuture
from dataclasses import dataclass

import torch

from engine.offload.cpu_side import CpuSide, HostWeight
from engine.offload.slicing.moved_part import MovedPart
from engine.device.queues import Future
from engine.offload.stats import WeightStats
from engine.model.feed_forward import SiluMul
from engine.model.layers import fused_silu_mul
from engine.quant import LinearMethod, LinearWeight
from engine.quant.int4 import DEFAULT_GROUP_SIZE, fuse, weight_columns, weight_rows
from scheduler.planning.slicing.rates import SliceKind

MLP_NAMES = ("gate_up", "down")  # a slice's weights, in image order


# ---- cutting a loaded layer's MLP ---------------------------------------------------------------
def slice_mlp(loaded: dict, counts: tuple[int, int, int]) -> dict[str, dict]:
    """A loaded layer's MLP cut into slices of `counts` (CC, CG, GG) intermediate units: for each
    slice with units, its fused gate/up rows ([gate | up], as LayerWeights fuses them) and down
    columns, as the linear methods take them."""
    slices, start = {}, 0
    for name, num_units in zip(SliceKind, counts):
        end = start + num_units
        if num_units:
            gate_up = fuse([weight_rows(loaded["gate_proj"], start, end), weight_rows(loaded["up_proj"], start, end)])
            slices[name] = {"gate_up": gate_up, "down": weight_columns(loaded["down_proj"], start, end)}
        start = end
    return slices


# Dense slices are cut on multiples of this many units, so the GEMMs' inner dimension (down's
# input) stays a multiple of the kernels' blocking (unaligned cuts decoded slower, docs/benchmarks.md).
DENSE_SLICE_UNITS = 64


def unit_alignment(linear: LinearMethod) -> int:
    """The units a slice's size is a multiple of: INT4 groups down's input dimension; dense
    slices keep the GEMMs' blocking (DENSE_SLICE_UNITS)."""
    return getattr(linear, "group_size", DEFAULT_GROUP_SIZE) if linear.takes_packed_int4 else DENSE_SLICE_UNITS


@dataclass
class _CcCall:
    """CC's part of one MLP call in flight: the CPU's rows (the last ones) and CG''s (the first)."""

    on_cpu: Future | None = None  # -> [num_tokens - num_moved, hidden] on the host
    moved_x: torch.Tensor | None = None  # [num_moved, hidden], the rows CG' computes
    moved_copy: CopyFuture | None = None  # CC's weights on their way to the GPU


class SlicedMlp:
    """One layer's MLP as slices: CC's weights on the host, CG's streamed (StreamedWeights), GG's
    resident. With `moved`, some of a forward's rows get CC's units from CG' on the GPU."""

    def __init__(self, layer: int, slices: dict[SliceKind, dict[str, LinearWeight]], counts: tuple[int, int, int],
                 cpu: CpuSide, stats: WeightStats, moved: MovedPart | None = None) -> None:
        self.layer = layer
        self.slices = slices  # CC / CG / GG -> {"gate_up": ..., "down": ...}, slices with units only
        self.counts = dict(zip(SliceKind, counts))
        self.cpu = cpu
        self.stats = stats
        self.moved = moved

    def apply(self, x: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        """x [num_tokens, hidden] (normalized) -> [num_tokens, hidden]: CC handed over first, then
        the GPU's slices, then CC's output added."""
        call = self._start_cc(x)
        out = None
        for kind in (SliceKind.CG, SliceKind.GG):
            if kind in self.slices:
                weights = self.slices[kind]
                partial = weights["down"].apply(silu_mul(weights["gate_up"].apply(x)))
                out = partial if out is None else out + partial
        if call is not None:
            cc = self._finish_cc(call, x.device)
            out = cc if out is None else out + cc
        return out

    def linear_weights(self) -> tuple[LinearWeight, ...]:
        """Every slice's weights, CC's reported in host memory."""
        return tuple(HostWeight(w) if kind == SliceKind.CC else w
                     for kind, weights in self.slices.items() for w in weights.values())

    def _start_cc(self, x: torch.Tensor) -> _CcCall | None:
        """Hand CC's part of x over: the first rows the policy moves go to CG' (their weights' copy
        launched first, so the link starts at once), the rest to the CPU."""
        if SliceKind.CC not in self.slices:
            return None
        num_moved = 0 if self.moved is None else self.moved.count(self.layer, x.shape[0])
        call = _CcCall()
        if num_moved:
            call.moved_copy, call.moved_x = self.moved.load(self.layer), x[:num_moved]
        if not num_moved == x.shape[0] > 0:  # rows left, or none at all (an empty sub-batch: [0, hidden])
            x_host = self.cpu.queue.copy_to_host(x[num_moved:])
            call.on_cpu = self.cpu.queue.run_on_host(lambda: self._compute_cc(x_host))
        return call

    def _compute_cc(self, x_host: Future) -> torch.Tensor:
        start = time.perf_counter()
        weights = self.slices[SliceKind.CC]
        x = x_host.result()  # [num_cpu_tokens, hidden] on the host
        with self.cpu.threads():
            out = weights["down"].apply(fused_silu_mul(weights["gate_up"].apply(x)))
        self.stats.num_cc_calls += 1
        self.stats.num_cc_tokens += x.shape[0]
        self.stats.cc_s += time.perf_counter() - start
        self.stats.cc_thread_ids.add(threading.get_ident())
        return out  # [num_cpu_tokens, hidden]

    def _compute_moved(self, call: _CcCall) -> torch.Tensor:
        """CG': CC's units for the moved rows, on the GPU from the copied weights."""
        weights = self.moved.weights(self.layer, call.moved_copy)
        out = weights["down"].apply(fused_silu_mul(weights["gate_up"].apply(call.moved_x)))
        self.moved.done()
        self.stats.num_moved_tokens += call.moved_x.shape[0]
        self.stats.moved_thread_ids.add(threading.get_ident())
        return out  # [num_moved, hidden]

    def _finish_cc(self, call: _CcCall, device: torch.device) -> torch.Tensor:
        """CC's units' output, [num_tokens, hidden] on `device`: CG''s rows computed now, then the
        CPU's (waited for)."""
        outputs = []
        if call.moved_copy is not None:
            outputs.append(self._compute_moved(call))
        if call.on_cpu is not None:
            outputs.append(call.on_cpu.result().to(device, non_blocking=True))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
