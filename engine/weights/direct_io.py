"""Reading per-layer weight files with O_DIRECT (PIPO sec. 3.3's disk transfer suite).

O_DIRECT bypasses the page cache: a read goes to the disk every time (so a second run measures
the disk, not RAM) and lands straight in the caller's buffer, which must be aligned, like the
file offset and the length, to the device's logical block (IO_ALIGN_BYTES covers 512 B and 4 KiB
sectors). A layer is read block by block by several threads at once (the disk serves several
requests in flight faster than one), and each block is handed on (`on_block`) as soon as it
lands, so its copy to the GPU overlaps the reads still in flight.

Where the filesystem refuses O_DIRECT (tmpfs, some FUSE and network filesystems) the files are
read through the page cache instead; `open_for_reading` says why, and the caller logs it once.
"""
from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv.host_memory import HUGE_PAGE_BYTES, advise_huge_pages
from scheduler.planning import IMAGE_ALIGN_BYTES

IO_ALIGN_BYTES = IMAGE_ALIGN_BYTES
# PIPO App. A: 8 MB blocks read fastest from an NVMe disk into host memory; on this repository's
# VM disk 8 MiB blocks with 4 in flight reached fio's best sequential rate too.
DEFAULT_BLOCK_BYTES = 8 * 2**20
O_DIRECT_FLAG = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class OpenFile:
    fd: int
    direct: bool  # whether reads bypass the page cache
    reason: str  # why not, when not


def open_for_reading(path: str | os.PathLike[str]) -> OpenFile:
    """The file opened with O_DIRECT where the filesystem allows it, else plainly (with the reason)."""
    if not O_DIRECT_FLAG:
        return OpenFile(os.open(path, os.O_RDONLY), False, "this platform has no O_DIRECT")
    try:
        return OpenFile(os.open(path, os.O_RDONLY | O_DIRECT_FLAG), True, "")
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return OpenFile(os.open(path, os.O_RDONLY), False,
                        f"the filesystem of {path} refuses O_DIRECT ({exc.strerror}); reading through the page cache")


def is_direct(fd: int) -> bool:
    """Whether reads of `fd` bypass the page cache (the kernel's own flag on the open file)."""
    import fcntl

    return bool(O_DIRECT_FLAG and fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT_FLAG)


def aligned_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 host buffer of `nbytes` starting on an IO_ALIGN_BYTES boundary, as
    O_DIRECT reads need; page-locked (pinned) for a CUDA copy engine when asked. Unpinned buffers
    of a huge page or more start on one and are advised onto transparent huge pages before their
    first touch: copying a layer between two such buffers ran at 12-13.5 GB/s on the 2-core VM
    against 9.5-10 on 4 KiB pages (a page walk per 4 KiB on both sides), and the layer's matmuls
    read it with fewer TLB misses too."""
    alignment = HUGE_PAGE_BYTES if nbytes >= HUGE_PAGE_BYTES and not pin_memory else IO_ALIGN_BYTES
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    offset = -raw.data_ptr() % alignment
    if alignment == HUGE_PAGE_BYTES:
        advise_huge_pages(raw.data_ptr() + offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return raw[offset:offset + nbytes]  # a view: it keeps `raw` alive


def writable_memoryview(buffer: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor as a writable buffer for os.preadv."""
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise ValueError("reads land in a contiguous uint8 host tensor")
    return memoryview((ctypes.c_ubyte * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


class DirectReader:
    """Reads file regions into aligned host buffers: blocks of `block_bytes`, `num_threads` of them
    in flight. One read at a time per reader (the caller serialises loads, as PIPO's thread pool
    runs one weight load at a time)."""

    def __init__(self, num_threads: int = 4, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 initializer: Callable[[], None] | None = None) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if block_bytes < IO_ALIGN_BYTES or block_bytes % IO_ALIGN_BYTES:
            raise ValueError(f"block_bytes must be a positive multiple of {IO_ALIGN_BYTES}, got {block_bytes}")
        self.num_threads = num_threads
        self.block_bytes = block_bytes
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tandem-disk-read", initializer=initializer)
        self._lock = threading.Lock()

    def read(self, file: OpenFile, offset: int, nbytes: int, into: torch.Tensor,
             on_block: Callable[[int, int], None] | None = None) -> None:
        """Read [offset, offset + nbytes) of the file into into[:nbytes]; `on_block(start, end)` is
        called on this thread for each block as it lands (in completion order)."""
        if file.direct and (offset % IO_ALIGN_BYTES or nbytes % IO_ALIGN_BYTES or into.data_ptr() % IO_ALIGN_BYTES):
            raise ValueError(f"O_DIRECT reads need offset, length and buffer aligned to {IO_ALIGN_BYTES} bytes")
        if into.numel() < nbytes:
            raise ValueError(f"buffer of {into.numel()} bytes for a {nbytes}-byte read")
        view = writable_memoryview(into[:nbytes])
        landed: queue.SimpleQueue = queue.SimpleQueue()
        blocks = [(start, min(start + self.block_bytes, nbytes)) for start in range(0, nbytes, self.block_bytes)]
        with self._lock:
            for start, end in blocks:
                self._pool.submit(self._read_block, file.fd, view, offset, start, end, landed)
            error = None
            for _ in blocks:
                start, end, exc = landed.get()
                if exc is not None:
                    error = error or exc
                elif on_block is not None and error is None:
                    on_block(start, end)
        if error is not None:
            raise error

    @staticmethod
    def _read_block(fd: int, view: memoryview, offset: int, start: int, end: int, landed: queue.SimpleQueue) -> None:
        try:
            done = start
            while done < end:  # a read may return fewer bytes than asked
                count = os.preadv(fd, [view[done:end]], offset + done)
                if count == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done}")
                done += count
            landed.put((start, end, None))
        except BaseException as exc:  # handed to the reading thread
            landed.put((start, end, exc))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
