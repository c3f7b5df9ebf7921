"""One layer file's own description of itself: a header in front of the layer image, so that a
file is trusted for what it says it holds, not for its name or the manifest beside it.

    [header: header_bytes, a multiple of IO_ALIGN_BYTES] [payload: the layer image, payload_bytes]

The header opens with a fixed prefix (magic, header_bytes, the JSON's length and CRC-32) and then
JSON: the format version, the conversion key (which model, seed, dtype, quantization, kernel
layout), the layer index, its LayerImage, and the payload's byte count and CRC-32. The payload
starts on an IO_ALIGN_BYTES boundary, so it is read with O_DIRECT like a headerless file.

The checksum is zlib's CRC-32. Measured over a 128 MiB buffer on the 2-core VM (another test
suite running): zlib.crc32 3.0-4.1 GB/s; xxhash's xxh3_64 5.6-11.5, google-crc32c 4.4, blake3 3.8
(each an extra dependency); sha1 1.1-1.2, sha256 0.9-1.2, blake2b 0.5-0.6, md5 0.5. Verifying a
file is bound by its reads (the disk gives 2.7 GB/s here, and the reads run ahead of the hashing),
so a faster hash would not pay for a dependency. CRC-32 catches every burst of up to 32 flipped
bits and all but 2^-32 of other damage; a truncated file is caught first by its size.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.weights.direct_io import IO_ALIGN_BYTES, aligned_empty, open_for_reading, writable_memoryview
from engine.weights.layer_image import LayerImage

FORMAT_VERSION = 2  # 1: a bare image, no header
HEADER_MAGIC = b"TANDEMLF"
_PREFIX = struct.Struct("<8sIII")  # magic, header_bytes, JSON bytes, the JSON's CRC-32
MAX_HEADER_BYTES = 2**20  # a header claiming more is damage, not a layer's description
# Verifying reads blocks of this size, this many in flight, and hashes them in file order.
VERIFY_BLOCK_BYTES = 8 * 2**20
VERIFY_READS_IN_FLIGHT = 3


class HeaderError(ValueError):
    """A file whose header cannot be read: not a layer file, another format version, or damaged."""


@dataclass(frozen=True)
class LayerHeader:
    """What a layer file says it holds."""

    key: dict[str, Any]  # ConversionKey.to_dict()
    layer: int
    image: LayerImage
    payload_crc32: int
    format_version: int = FORMAT_VERSION

    @property
    def payload_bytes(self) -> int:
        return self.image.nbytes

    def encode(self) -> torch.Tensor:
        """The header as an aligned uint8 host buffer of a multiple of IO_ALIGN_BYTES (zero padded)."""
        body = json.dumps({"format_version": self.format_version, "key": self.key, "layer": self.layer,
                           "image": self.image.to_dict(), "payload_bytes": self.payload_bytes,
                           "payload_crc32": self.payload_crc32}, sort_keys=True).encode()
        header_bytes = -(-(_PREFIX.size + len(body)) // IO_ALIGN_BYTES) * IO_ALIGN_BYTES
        raw = _PREFIX.pack(HEADER_MAGIC, header_bytes, len(body), zlib.crc32(body)) + body
        buffer = aligned_empty(header_bytes).zero_()
        buffer[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return buffer


def read_header(path: Path) -> tuple[LayerHeader, int]:
    """The file's header and its size in bytes (where the payload starts); HeaderError saying
    what is wrong where it cannot be read."""
    with open(path, "rb") as file:
        head = file.read(IO_ALIGN_BYTES)
        if len(head) < _PREFIX.size:
            raise HeaderError(f"{len(head)} bytes long, shorter than a layer-file header")
        magic, header_bytes, body_bytes, body_crc32 = _PREFIX.unpack_from(head)
        if magic != HEADER_MAGIC:
            raise HeaderError("no layer-file header (a file of format version 1, written before headers, or "
                              "overwritten)")
        if header_bytes % IO_ALIGN_BYTES or not _PREFIX.size + body_bytes <= header_bytes <= MAX_HEADER_BYTES:
            raise HeaderError(f"header sizes damaged ({header_bytes} header bytes, {body_bytes} of JSON)")
        head += file.read(header_bytes - len(head))
    body = head[_PREFIX.size:_PREFIX.size + body_bytes]
    if len(body) < body_bytes or zlib.crc32(body) != body_crc32:
        raise HeaderError("header damaged (its CRC-32 does not match)")
    return _parse(json.loads(body)), header_bytes


def _parse(fields: dict[str, Any]) -> LayerHeader:
    if fields.get("format_version") != FORMAT_VERSION:
        raise HeaderError(f"format version {fields.get('format_version')}, this tandem reads {FORMAT_VERSION}")
    try:
        header = LayerHeader(fields["key"], int(fields["layer"]), LayerImage.from_dict(fields["image"]),
                             int(fields["payload_crc32"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise HeaderError(f"header incomplete ({exc!r})") from exc
    if int(fields["payload_bytes"]) != header.payload_bytes:
        raise HeaderError(f"header damaged (payload of {fields['payload_bytes']} bytes, its image "
                          f"{header.payload_bytes})")
    return header


def buffer_crc32(data: torch.Tensor) -> int:
    """CRC-32 of a contiguous uint8 host buffer (zlib releases the GIL while it hashes)."""
    return zlib.crc32(writable_memoryview(data))


def file_crc32(path: Path, offset: int, nbytes: int) -> int:
    """CRC-32 of the file's bytes [offset, offset + nbytes), read with O_DIRECT where the filesystem
    allows it (verifying does not fill the page cache): the next blocks are read while one is hashed."""
    file = open_for_reading(path)
    buffers = [aligned_empty(VERIFY_BLOCK_BYTES) for _ in range(VERIFY_READS_IN_FLIGHT)]
    views = [writable_memoryview(buffer) for buffer in buffers]  # `buffers` keeps their memory alive
    crc32 = 0
    try:
        with ThreadPoolExecutor(VERIFY_READS_IN_FLIGHT, thread_name_prefix="tandem-verify") as pool:
            pending: deque = deque()
            for count, start in enumerate(range(0, nbytes, VERIFY_BLOCK_BYTES)):
                if len(pending) == VERIFY_READS_IN_FLIGHT:  # its buffer is the one this block reuses
                    crc32 = zlib.crc32(pending.popleft().result(), crc32)
                view = views[count % VERIFY_READS_IN_FLIGHT][:min(VERIFY_BLOCK_BYTES, nbytes - start)]
                pending.append(pool.submit(_read_exactly, file.fd, view, offset + start))
            while pending:
                crc32 = zlib.crc32(pending.popleft().result(), crc32)
    finally:
        os.close(file.fd)
    return crc32


def _read_exactly(fd: int, view: memoryview, offset: int) -> memoryview:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise OSError(f"the file ends at byte {offset + done}, before its payload does")
        done += count
    return view
