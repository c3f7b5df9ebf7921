"""ScheInfer's prefill token assignment (sec. IV-B, CG'): for the tokens a `MovedTokens` policy
names (scheduler/planning/slicing/moved_tokens.py), a sliced MLP's CC units are computed on the
GPU from CC's weights, copied into one GPU buffer as the MLP starts, instead of
by the CPU. Decode-sized forwards usually move nothing."""
from __future__ import annotations

import threading
from concurrent.futures import Future as CopyFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from engine.offload.ring import BUFFER_FORMAT
from engine.offload.stats import WeightStats
from engine.offload.transfer import CopyEngine, pin_to
from engine.quant import LinearWeight
from engine.weights.layer_image import LayerImage, meta_templates
from scheduler.planning.slicing.moved_tokens import MovedTokens
from scheduler.planning.tiers import Tier

MOVED_HOST_FORMAT = "CG' host copies"  # weight_bytes' format label for CC in the GPU's format


class MovedPart:
    """CG' (ScheInfer sec. IV-B): CC's weights, stored on the host, copied into one GPU
    buffer for the tokens a forward moves off the CPU (`MovedTokens` says how many per layer).

    The host bytes copies leave from: where the GPU is a host thread (device cpu, the
    testbed) it computes from the CPU's format, so CC's weights are one host image per layer and
    the CPU part's weights are views into it (shared, no second copy; INT4 kernels are shared
    too, which is safe because the testbed refuses INT4 and device cpu has one thread pool).
    Elsewhere (CUDA: Triton's INT4 layout, pinned memory for asynchronous copies) a second host
    image in the GPU's format is kept beside the CPU's weights.

    Copies go through the store's copy engine on a transfer thread of their own (a real memcpy on
    the host-side cores on the testbed; queued on the copy stream on CUDA), launched as the MLP
    starts so they overlap GG's and CG's compute; not on the ring's thread, whose next load may
    be waiting for this very layer's release. One buffer is enough: a CG' lives within one
    SlicedMlp.apply, and the GPU runs a forward's
    MLPs (Neo's two sub-batches' too) one after the other, never interleaved, so the next copy
    is launched only once the last CG' was computed (on CUDA, queued: the copy waits for the event
    `done` records, as a ring load waits for its buffer's release)."""

    def __init__(self, policy: MovedTokens, copy_engine: CopyEngine, shares_host_bytes: bool,
                 stats: WeightStats) -> None:
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
                     for_gpu: Callable[[], dict[str, LinearWeight]]) -> dict[str, LinearWeight]:
        """Keep layer `layer`'s CC image for copies; -> the CPU part's weights (views into that
        image where the bytes are shared). `for_gpu()` builds CC in the GPU's format."""
        if self.shares_host_bytes:
            image, templates, data = self._host[layer] = host_image(cpu_weights, self.copy_engine.allocate_host)
            return image.bind(templates, data)
        self._host[layer] = host_image(for_gpu(), self.copy_engine.allocate_host)
        return cpu_weights

    @property
    def largest_image_bytes(self) -> int:
        return max((image.nbytes for image, _, _ in self._host.values()), default=0)

    def start(self) -> None:
        """Allocate the buffer for CC's largest image, and bind each layer's weights in it."""
        if not self._host:
            return
        self.stats.moves = True
        self._buffer = self.copy_engine.allocate_buffer(self.largest_image_bytes)
        self._bound = {layer: image.bind(templates, self._buffer)
                       for layer, (image, templates, _) in self._host.items()}

    @property
    def buffer_bytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def extra_weight_bytes(self) -> dict[tuple[str, str], int]:
        """The buffer, and the host images where they are not the CPU's weights, by (format, tier)."""
        host_bytes = 0 if self.shares_host_bytes else sum(image.nbytes for image, _, _ in self._host.values())
        extra = {(BUFFER_FORMAT, Tier.GPU): self.buffer_bytes, (MOVED_HOST_FORMAT, Tier.HOST): host_bytes}
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
        self.copy_engine.load(self._buffer[:image.nbytes], data[:image.nbytes], self._state)
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


def host_image(linears: dict[str, LinearWeight], allocate) -> tuple[LayerImage, dict[str, LinearWeight], torch.Tensor]:
    """The weights' image written into a host buffer from `allocate(nbytes)`: (image, meta
    templates, bytes)."""
    image = LayerImage.of(linears)
    data = allocate(image.nbytes)
    image.write(linears, data)
    return image, meta_templates(linears), data
