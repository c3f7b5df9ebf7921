"""The offload directory: one merged, aligned file per decoder layer (its layer image) and a
manifest saying what they were made from (PIPO sec. 3.3's data merging, for the disk tier).

`tandem convert` writes every layer ahead of time; `tandem serve` reuses the files whose
manifest entry matches what it would write (same source, dtype, quantization, kernel layout and
image layout) and writes the others. Files are written with O_DIRECT where the filesystem allows
it, so converting a model does not fill the page cache with it.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.weights.base import WeightLoadError
from engine.weights.direct_io import O_DIRECT_FLAG, IO_ALIGN_BYTES, OpenFile, open_for_reading, writable_memoryview
from engine.weights.layer_image import LayerImage

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LAYER_FILE_PATTERN = "layer-*.bin"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ConversionKey:
    """What a directory's files were made from; files are reused only under an equal key."""

    source: str  # the loader's source (file, directory, or dummy:<preset>)
    seed: int  # dummy weights' seed (0 for real checkpoints, where it changes nothing)
    dtype: str  # the compute dtype dense weights are stored in
    quantization: str  # none | int4
    layout: str  # whose kernels read the images: the GPU's device type ("cpu", "cuda")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def create(cls, source: str, dtype: torch.dtype, quantization: str, gpu: torch.device,
               seed: int = 0) -> "ConversionKey":
        """The key of files made from `source` for `gpu`'s kernels (`seed`: dummy weights')."""
        return cls(source=source, seed=seed, dtype=str(dtype).removeprefix("torch."), quantization=quantization,
                   layout=torch.device(gpu).type)


class LayerFiles:
    """The per-layer files of one offload directory."""

    def __init__(self, directory: str | os.PathLike[str], key: ConversionKey, num_layers: int) -> None:
        self.directory = Path(directory)
        self.key = key
        self.num_layers = num_layers
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WeightLoadError(f"offload directory {self.directory}: {exc.strerror}") from exc
        self._entries: dict[int, dict[str, Any]] = self._read_manifest()

    def path(self, index: int) -> Path:
        return self.directory / f"layer-{index:04d}.bin"

    def has_layer(self, index: int, image: LayerImage) -> bool:
        """Whether the layer's file holds this image already."""
        entry = self._entries.get(index)
        return (entry is not None and LayerImage.from_dict(entry["image"]) == image
                and self.path(index).is_file() and self.path(index).stat().st_size == image.nbytes)

    def image(self, index: int) -> LayerImage:
        return LayerImage.from_dict(self._entries[index]["image"])

    def write_layer(self, index: int, image: LayerImage, data: torch.Tensor) -> None:
        """Write the image (`data`: an aligned host buffer holding it) as the layer's file."""
        path = self.path(index)
        tmp = path.with_suffix(".tmp")
        write_file(tmp, data[:image.nbytes])
        os.replace(tmp, path)
        self._entries[index] = {"file": path.name, "image": image.to_dict()}
        self._write_manifest()

    def open(self, index: int) -> OpenFile:
        return open_for_reading(self.path(index))

    def _read_manifest(self) -> dict[int, dict[str, Any]]:
        path = self.directory / MANIFEST_NAME
        if not path.is_file():
            return {}
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("%s unreadable (%s); its layer files will be written again", path, exc)
            return {}
        if manifest.get("format_version") != FORMAT_VERSION or manifest.get("key") != self.key.to_dict():
            logger.info("%s holds another conversion (%s); its layer files will be written again",
                        self.directory, manifest.get("key"))
            return {}
        return {int(index): entry for index, entry in manifest.get("layers", {}).items()}

    def _write_manifest(self) -> None:
        manifest = {"format_version": FORMAT_VERSION, "key": self.key.to_dict(), "num_layers": self.num_layers,
                    "layers": {str(index): entry for index, entry in sorted(self._entries.items())}}
        tmp = self.directory / f"{MANIFEST_NAME}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, self.directory / MANIFEST_NAME)


def write_file(path: Path, data: torch.Tensor) -> None:
    """Write an aligned uint8 host buffer as the whole file, bypassing the page cache where possible."""
    view = writable_memoryview(data)
    direct = bool(O_DIRECT_FLAG) and data.data_ptr() % IO_ALIGN_BYTES == 0 and data.numel() % IO_ALIGN_BYTES == 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | (O_DIRECT_FLAG if direct else 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)  # the filesystem refuses O_DIRECT: write through the page cache
    try:
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
        os.fsync(fd)
    finally:
        os.close(fd)
