"""`tandem convert`: a model's decoder layers written as per-layer merged files in an offload
directory (engine/weights/layer_files.py), each the layer image its streamed weights are read from
(INT4 kept packed, or dense in the compute dtype). Any loader's source converts: GGUF (Q4 blocks
kept as they are for --quantization int4), safetensors, or a dummy preset.

Before writing any file, the files already there are checked (LayerFiles.check_space) and the
bytes of those to write compared with the filesystem's free space; `verify` checks the files
without the source weights (`tandem convert --verify`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.model_config import ConfigError
from engine.model.layer_weights import LayerWeights
from engine.quant import LinearMethod
from engine.weights.base import WeightLoader, WeightLoadError
from engine.weights.direct_io import aligned_empty
from engine.weights.layer_files import ConversionKey, LayerFiles
from engine.weights.layer_image import LayerImage
from scheduler.planning import WeightFormat, layer_image_bytes

logger = logging.getLogger(__name__)


def conversion_key(config: EngineConfig, source: str, dtype: torch.dtype) -> ConversionKey:
    """What an offload directory's files are made from under this config."""
    return ConversionKey.create(source, dtype, config.quantization, torch.device(config.torch_device),
                                seed=config.seed if config.load_format == "dummy" else 0)


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
    """Write every layer's file (those already holding their image intact are kept); refused
    before writing any where the filesystem has no room for them. -> (layers written, kept)"""
    config = loader.config
    if config.is_moe:
        raise ConfigError(f"{config.architecture}: layer files hold dense Llama layers; mixture-of-experts "
                          "layers are served resident and have none")
    files.check_space(range(config.num_layers),
                      layer_image_bytes(config.shape, WeightFormat(files.key.quantization, dtype.itemsize)))
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


def verify(files: LayerFiles) -> int:
    """Check every layer's file (header, conversion, layer, size, payload CRC-32) with no source
    weights to write one again: WeightLoadError naming each file that is missing or damaged.
    -> the number of layer files checked."""
    problems = []
    for index in range(files.num_layers):
        check = files.check(index)
        if not check.intact:
            problems.append(f"{files.path(index)}: {check.problem if check.exists else 'missing'}")
    if problems:
        raise WeightLoadError(f"{len(problems)} of {files.num_layers} layer files in {files.directory} cannot be "
                              f"used:\n  " + "\n  ".join(problems) + "\nrun `tandem convert` without --verify "
                              "(same model and flags) to write them again")
    return files.num_layers
