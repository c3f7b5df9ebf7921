"""`tandem convert`: a model's decoder layers written as per-layer merged files in an offload
directory (engine/weights/layer_files.py), each the layer image its streamed weights are read from
(INT4 kept packed, or dense in the compute dtype). Any loader's source converts: GGUF (Q4 blocks
kept as they are for --quantization int4), safetensors, or a dummy preset."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.model import ConfigError
from engine.model.llama import LayerWeights
from engine.quant import LinearMethod
from engine.weights.base import WeightLoader
from engine.weights.direct_io import aligned_empty
from engine.weights.layer_files import LayerFiles
from engine.weights.layer_image import LayerImage

logger = logging.getLogger(__name__)


@dataclass
class HostLayer:
    """A decoder layer built on the host for streaming: its weights, their image and the image's bytes."""

    weights: LayerWeights
    image: LayerImage
    data: torch.Tensor  # uint8 [image.nbytes], aligned for O_DIRECT


def build_host_layer(loader: WeightLoader, index: int, linear: LinearMethod, dtype: torch.dtype,
                     layout_device: torch.device, allocate=aligned_empty, loaded: dict | None = None) -> HostLayer:
    """Layer `index` as the linear method makes it for `layout_device`'s kernels, kept on the
    host, and written into a host buffer from `allocate(nbytes)`."""
    if loaded is None:
        loaded = (loader.load_layer_packed if linear.takes_packed_int4 else loader.load_layer)(index, dtype)
    weights = LayerWeights.from_loaded(loaded, linear, dtype, torch.device("cpu"), layout_device=layout_device)
    linears = weights.named_linears()
    image = LayerImage.of(linears)
    data = allocate(image.nbytes)
    image.write(linears, data)
    return HostLayer(weights, image, data)


def convert(loader: WeightLoader, files: LayerFiles, linear: LinearMethod, dtype: torch.dtype,
            layout_device: torch.device, show_progress: bool = False) -> tuple[int, int]:
    """Write every layer's file (those already holding their image are kept). -> (layers written, kept)"""
    if loader.config.is_moe:
        raise ConfigError(f"{loader.config.architecture}: layer files hold dense Llama layers; mixture-of-experts "
                          "layers are served resident and have none")
    written = kept = 0
    for index in tqdm(range(loader.config.num_layers), desc="converting layers", unit="layer",
                      disable=not show_progress):
        layer = build_host_layer(loader, index, linear, dtype, layout_device)
        if files.has_layer(index, layer.image):
            kept += 1
        else:
            files.write_layer(index, layer.image, layer.data)
            written += 1
    return written, kept
