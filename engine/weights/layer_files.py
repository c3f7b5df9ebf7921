"""The offload directory: one merged, aligned file per decoder layer (its layer image) and a
manifest listing them (PIPO sec. 3.3's data merging, for the disk tier).

`tandem convert` writes every layer ahead of time; `tandem serve` reuses the files that hold what
it would write and writes the others. Each file says in its own header what it holds
(layer_file_format.py: format version, conversion key, layer, image layout, payload bytes and
CRC-32), and a file is used only when all of it matches and its payload's CRC-32 checks: a
truncated, bit-flipped or other model's file is never read by a forward. The manifest is a
summary for people and tools; the headers decide.

Files are checked once, when the caller decides to reuse them, before anything is written
(`check_space`): serve does it at start, where it can still write a damaged file again from the
layer image it builds from the source weights (a check on a forward's first read would find the
damage with the image gone and a request waiting). Verifying reads each file once with O_DIRECT
and hashes it: 0.56-0.64 s per GB on the 2-core VM with another test suite running, where the
reads alone took 0.46-0.57 (CRC-32 hashes while the next blocks are read: the disk bounds it).
Without source weights (`tandem convert --verify`) a damaged file is refused by name.

Files are written with O_DIRECT where the filesystem allows it, so converting a model does not
fill the page cache with it, and all or nothing (file_writes.py); the bytes to write are checked
against the filesystem's free space before the first file is.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from engine.weights.base import WeightLoadError
from engine.weights.direct_io import IO_ALIGN_BYTES, OpenFile, open_for_reading
from engine.weights.file_writes import TMP_SUFFIX, check_free_space, free_bytes, peak_bytes, write_file
from engine.weights.layer_file_format import (
    FORMAT_VERSION,
    HeaderError,
    LayerHeader,
    buffer_crc32,
    file_crc32,
    read_header,
)
from engine.weights.layer_image import LayerImage

__all__ = ["ConversionKey", "LayerFiles", "LayerFileCheck", "room_bytes", "write_file", "LAYER_FILE_PATTERN",
           "MANIFEST_NAME"]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LAYER_FILE_PATTERN = "layer-*.bin"
# Headers are one alignment block unless an image has unusually many tensors (then a few more).
HEADER_BYTES_ESTIMATE = IO_ALIGN_BYTES


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


@dataclass(frozen=True)
class LayerFileCheck:
    """What one layer's file was found to hold."""

    exists: bool
    header: LayerHeader | None = None  # set when the file is intact and of this conversion
    payload_offset: int = 0  # the header's bytes
    problem: str = ""  # why an existing file cannot be used

    @property
    def intact(self) -> bool:
        return self.header is not None


class LayerFiles:
    """The per-layer files of one offload directory, for one conversion `key`."""

    def __init__(self, directory: str | os.PathLike[str], key: ConversionKey, num_layers: int) -> None:
        self.directory = Path(directory)
        self.key = key
        self.num_layers = num_layers
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WeightLoadError(f"offload directory {self.directory}: {exc.strerror}") from exc
        self._remove_temporaries()
        self._checks: dict[int, LayerFileCheck] = {}
        self._entries: dict[int, dict[str, Any]] = self._read_manifest()

    def path(self, index: int) -> Path:
        return self.directory / f"layer-{index:04d}.bin"

    # ---- reading: what the files hold ----------------------------------------------------------
    def check(self, index: int) -> LayerFileCheck:
        """Layer `index`'s file checked (header, size and payload CRC-32), once: later calls, and
        files this object wrote, answer from memory."""
        if index not in self._checks:
            self._checks[index] = self._check(index)
        return self._checks[index]

    def _check(self, index: int) -> LayerFileCheck:
        path = self.path(index)
        if not path.exists():
            return LayerFileCheck(False)
        try:
            header, header_bytes = read_header(path)
            problem = self._header_problem(index, header) or self._payload_problem(path, header, header_bytes)
        except HeaderError as exc:
            return LayerFileCheck(True, problem=str(exc))
        except OSError as exc:
            return LayerFileCheck(True, problem=f"unreadable ({exc.strerror or exc})")
        if problem:
            return LayerFileCheck(True, payload_offset=header_bytes, problem=problem)
        return LayerFileCheck(True, header, header_bytes)

    def _header_problem(self, index: int, header: LayerHeader) -> str:
        if header.key != self.key.to_dict():
            return f"made from another conversion ({header.key}), not {self.key.to_dict()}"
        if header.layer != index:
            return f"its header says it holds layer {header.layer}"
        return ""

    @staticmethod
    def _payload_problem(path: Path, header: LayerHeader, header_bytes: int) -> str:
        file_bytes, expected_bytes = path.stat().st_size, header_bytes + header.payload_bytes
        if file_bytes < expected_bytes:
            return f"truncated: {file_bytes} bytes, its header says {expected_bytes}"
        if file_bytes > expected_bytes:
            return f"{file_bytes} bytes, longer than the {expected_bytes} its header says"
        crc32 = file_crc32(path, header_bytes, header.payload_bytes)
        if crc32 != header.payload_crc32:
            return f"payload damaged: its CRC-32 is {crc32:08x}, its header says {header.payload_crc32:08x}"
        return ""

    def has_layer(self, index: int, image: LayerImage) -> bool:
        """Whether the layer's file holds this image, intact. An existing file that does not
        (damaged, or another model's or layout's) is logged by name: the caller, which has the
        source weights, writes it again."""
        check = self.check(index)
        if check.intact and check.header.image == image:
            return True
        if check.exists:
            logger.warning("layer file %s: %s; writing it again from the source weights", self.path(index),
                           check.problem or "it holds another image layout of this layer")
        return False

    def verify(self, index: int) -> LayerImage:
        """The image layer `index`'s file holds; WeightLoadError naming the file and what to do
        where it is missing or cannot be used (for callers without the source weights)."""
        check = self.check(index)
        if check.intact:
            return check.header.image
        raise WeightLoadError(f"layer file {self.path(index)}: {check.problem if check.exists else 'missing'}; "
                              f"write it again with `tandem convert` of the model with --offload-dir "
                              f"{self.directory} (`tandem serve` writes it too)")

    def payload_offset(self, index: int) -> int:
        """Where the layer's image starts in its file (a multiple of IO_ALIGN_BYTES)."""
        self.verify(index)
        return self.check(index).payload_offset

    def open(self, index: int) -> OpenFile:
        return open_for_reading(self.path(index))

    # ---- writing ------------------------------------------------------------------------------
    def check_space(self, indices: Iterable[int], image_bytes: int) -> list[int]:
        """Before writing any file: the layers among `indices` whose files are missing or cannot
        be used (each file checked, see `check`); WeightLoadError with the bytes needed, free and
        missing where the filesystem has no room for their files of `image_bytes` (the planner's
        count) and a header each. -> those layers."""
        to_write = [index for index in indices if not self.check(index).intact]
        writes = [(HEADER_BYTES_ESTIMATE + image_bytes, self._file_bytes(index)) for index in to_write]
        if to_write:
            check_free_space(self.directory, peak_bytes(writes),
                             f"{len(to_write)} layer files to write ({describe_layers(to_write)})")
        return to_write

    def _file_bytes(self, index: int) -> int:
        try:
            return self.path(index).stat().st_size
        except FileNotFoundError:
            return 0

    def write_layer(self, index: int, image: LayerImage, data: torch.Tensor) -> None:
        """Write the image (`data`: an aligned host buffer holding it) as the layer's file, with
        its header; WeightLoadError where the write fails (nothing partial is left)."""
        payload = data[:image.nbytes]
        header = LayerHeader(self.key.to_dict(), index, image, buffer_crc32(payload))
        encoded = header.encode()
        self._checks.pop(index, None)
        write_file(self.path(index), encoded, payload)
        self._checks[index] = LayerFileCheck(True, header, encoded.numel())
        self._entries[index] = {"file": self.path(index).name, "payload_offset": encoded.numel(),
                                "payload_crc32": header.payload_crc32, "image": image.to_dict()}
        self._write_manifest()

    def _remove_temporaries(self) -> None:
        """What an interrupted write left: never a complete file, only space taken."""
        stale = [*self.directory.glob(f"layer-*{TMP_SUFFIX}"), self.directory / f"{MANIFEST_NAME}{TMP_SUFFIX}"]
        for path in stale:
            if path.is_file():
                logger.info("removing %s, left by an interrupted write", path)
                path.unlink(missing_ok=True)

    def _read_manifest(self) -> dict[int, dict[str, Any]]:
        path = self.directory / MANIFEST_NAME
        if not path.is_file():
            return {}
        try:
            manifest = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("%s unreadable (%s); it will be written again", path, exc)
            return {}
        if manifest.get("format_version") != FORMAT_VERSION or manifest.get("key") != self.key.to_dict():
            logger.info("%s lists another conversion or format (%s, format %s); layer files not of this one will be "
                        "written again", path, manifest.get("key"), manifest.get("format_version"))
            return {}
        return {int(index): entry for index, entry in manifest.get("layers", {}).items()}

    def _write_manifest(self) -> None:
        manifest = {"format_version": FORMAT_VERSION, "key": self.key.to_dict(), "num_layers": self.num_layers,
                    "layers": {str(index): entry for index, entry in sorted(self._entries.items())}}
        text = json.dumps(manifest, indent=1).encode()
        write_file(self.directory / MANIFEST_NAME, torch.frombuffer(bytearray(text), dtype=torch.uint8))


def room_bytes(directory: str | os.PathLike[str]) -> int:
    """What layer files may take in `directory` (which exists): its filesystem's free bytes and
    those of the layer files already there, each to be reused or replaced (the planner's disk
    budget; `check_space` counts exactly once the files are checked)."""
    directory = Path(directory)
    existing = sum(path.stat().st_size for path in directory.glob(LAYER_FILE_PATTERN) if path.is_file())
    return free_bytes(directory) + existing


def describe_layers(indices: list[int]) -> str:
    """'layers 0-3, 7' for [0, 1, 2, 3, 7]."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return "layers " + ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
