"""How long one forward takes when some layers' weights stream in (PIPO sec. 3.2, Alg. 1), in
simulated time: the estimate the planner ranks placements by.

The engine's streaming pipeline (engine/offload/ring.py) loads streamed layers one at
a time, in the order the forward uses them and round and round across forwards, each into the
next of `num_buffers` GPU buffers once the layer that used it has been released. The
forward computes layer after layer and waits for a streamed layer's load before computing it.
This module replays exactly that with given per-layer times, so a placement's iteration time
includes the bubbles its buffers and its spread of streamed layers leave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Forwards replayed; the last one's duration is the steady state (the first pays the cold start).
NUM_REPLAYED_FORWARDS = 3


@dataclass(frozen=True)
class ForwardTimeline:
    """One steady-state forward."""

    iteration_s: float  # from the previous forward's end to this one's
    compute_s: float  # the GPU computing (layers and head)
    transfer_s: float  # the transfer engine loading layers
    stall_s: float  # the GPU waiting for a layer's weights
    overlap_s: float = 0.0  # computing and loading at once


def _overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]], start: float, end: float) -> float:
    """Time within [start, end) covered by an interval of `a` and one of `b` (each sorted, disjoint)."""
    a = [(max(s, start), min(e, end)) for s, e in a if e > start and s < end]
    b = [(max(s, start), min(e, end)) for s, e in b if e > start and s < end]
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def simulate_forward(compute_s: Sequence[float], transfer_s: Sequence[float | None], num_buffers: int,
                     head_s: float = 0.0, layers_in_use: int = 1) -> ForwardTimeline:
    """compute_s[i]: layer i's compute; transfer_s[i]: its load, None for a resident layer;
    head_s: the work between two forwards' layers (LM head, embedding, sampling), during which
    loads go on; layers_in_use: layers a forward holds at once (Neo's two-batch forward holds
    layer i until layer i+1 has run, counted here until layer i+1's end)."""
    streamed = [i for i, t in enumerate(transfer_s) if t is not None]
    if streamed and num_buffers < 1:
        raise ValueError("streamed layers need at least one buffer")
    link_free = 0.0  # when the transfer engine finishes its last load
    buffer_free = [0.0] * max(num_buffers, 1)  # when each buffer's last layer was released
    ready: dict[int, float] = {}  # load number -> when its layer is in its buffer
    num_loads = 0  # loads issued so far (load j fills buffer j % num_buffers)

    def load_until(index: int) -> None:
        nonlocal link_free, num_loads
        while num_loads <= index:
            layer = streamed[num_loads % len(streamed)]
            start = max(link_free, buffer_free[num_loads % num_buffers])
            link_free = ready[num_loads] = start + transfer_s[layer]
            loads.append((start, link_free))
            num_loads += 1

    def release(held: list[tuple[int, int]], through_layer: int, now: float) -> None:
        while held and held[0][0] <= through_layer:
            buffer_free[held.pop(0)[1] % num_buffers] = now

    now, use = 0.0, 0  # the GPU's clock; loads consumed so far
    ends, stall = [], 0.0
    loads: list[tuple[float, float]] = []
    computes: list[tuple[float, float]] = []
    for _ in range(NUM_REPLAYED_FORWARDS):
        stall, held = 0.0, []  # held: (layer, load number) of streamed layers not yet released
        for layer, seconds in enumerate(compute_s):
            if transfer_s[layer] is not None:
                load_until(use)  # load `use` may start once the buffer it reuses was released
                start = max(now, ready[use])
                stall += start - now
                now = start
                held.append((layer, use))
                use += 1
            computes.append((now, now + seconds))
            now += seconds
            release(held, layer - (layers_in_use - 1), now)
        release(held, len(compute_s), now)
        now += head_s
        ends.append(now)
    transfer_total = sum(t for t in transfer_s if t is not None)
    return ForwardTimeline(ends[-1] - ends[-2], sum(compute_s) + head_s, transfer_total, stall,
                           _overlap_s(computes, loads, ends[-2], ends[-1]))
