"""Writing the offload directory's files so that no failure leaves one that looks complete, and
checking that the filesystem has room for them before writing any.

A file is written under a temporary name (`<name>.tmp`), fsynced, renamed over its final name and
the directory fsynced: a crash leaves at most a `.tmp`, which LayerFiles removes on its next start.
A write that fails (ENOSPC, EIO) removes its temporary file and raises a WeightLoadError saying so.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable

import torch

from engine.weights.base import WeightLoadError
from engine.weights.direct_io import IO_ALIGN_BYTES, O_DIRECT_FLAG, writable_memoryview

TMP_SUFFIX = ".tmp"
GIB_BYTES = 2**30


def write_file(path: str | os.PathLike[str], *parts: torch.Tensor) -> None:
    """Write aligned uint8 host buffers one after the other as the whole file, bypassing the page
    cache where possible; all or nothing under `path` (module docstring)."""
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        _write_parts(tmp, parts)
        os.replace(tmp, path)
        fsync_directory(path.parent)
    except BaseException as exc:  # an interrupt too: never leave the temporary file behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WeightLoadError(describe_failed_write(path, exc)) from exc
        raise


def _write_parts(path: Path, parts: tuple[torch.Tensor, ...]) -> None:
    direct = bool(O_DIRECT_FLAG) and all(
        part.data_ptr() % IO_ALIGN_BYTES == 0 and part.numel() % IO_ALIGN_BYTES == 0 for part in parts)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | (O_DIRECT_FLAG if direct else 0), 0o644)
    except OSError:
        fd = os.open(path, flags, 0o644)  # the filesystem refuses O_DIRECT: write through the page cache
    try:
        offset = 0
        for part in parts:
            view = writable_memoryview(part)
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            offset += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable (the new name survives a crash)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_failed_write(path: Path, exc: OSError) -> str:
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    hint = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = f"; free space on the filesystem of {path.parent} or point --offload-dir at another one"
    elif exc.errno == errno.EIO:
        hint = "; the disk reported an I/O error: check it, or point --offload-dir at another one"
    return (f"writing {path} failed: {exc.strerror or exc}{f' ({code})' if code else ''}; nothing partial was "
            f"left (its temporary file was removed) and the files written before it are intact{hint}")


def free_bytes(directory: Path) -> int:
    """What an unprivileged writer may still write on `directory`'s filesystem (df's Avail)."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def peak_bytes(writes: Iterable[tuple[int, int]]) -> int:
    """The most the filesystem must hold beyond what it holds now while files are written in turn,
    each `(new_bytes, replaced_bytes)`: a new file sits beside the one it replaces until the rename."""
    grown = peak = 0
    for new_bytes, replaced_bytes in writes:
        peak = max(peak, grown + new_bytes)
        grown += new_bytes - replaced_bytes
    return peak


def check_free_space(directory: Path, needed_bytes: int, what: str) -> None:
    """WeightLoadError naming the directory and the bytes needed, free and missing where the
    filesystem has less room than `needed_bytes` for `what`."""
    free = free_bytes(directory)
    if needed_bytes <= free:
        return
    missing = needed_bytes - free
    raise WeightLoadError(
        f"offload directory {directory}: {what} need {_gib(needed_bytes)} ({needed_bytes} bytes) but its filesystem "
        f"has {_gib(free)} ({free} bytes) free: {_gib(missing)} ({missing} bytes) missing; nothing was written. "
        f"Free space there, or point --offload-dir at a filesystem with room")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB_BYTES:.2f} GiB"
