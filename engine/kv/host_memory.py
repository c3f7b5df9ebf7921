"""Host memory for KV pools: zeroed tensors on transparent 2 MiB pages."""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
from typing import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + length); False where the host refuses."""
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, _MADV_HUGEPAGE) == 0


def host_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on transparent 2 MiB pages where Linux grants them (plain pages elsewhere).

    The CPU attention kernel reads each (block, kv head) slice, 4 KiB in the common shapes, from
    anywhere in the pool: on 4 KiB pages that is a TLB miss and a page walk per slice, and the
    kernel ran ~1.1-1.2x slower (benchmarks/kernels/cpu_attention.py). The buffer is an anonymous
    mapping, over-allocated by one huge page so the tensor can start on a 2 MiB boundary and advised
    before its first touch. The kernel hands out its pages zeroed as they are first written, so a
    pool costs no time at start and only the memory its sequences reach (zeroing a default pool
    took over a second per engine)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES), dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    advise_huge_pages(raw.data_ptr() + offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    # A view: it keeps `raw`'s storage, and through it the mapping, alive.
    return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))
