"""The tensor-parallel ranks' collectives: over torch.distributed (NCCL between GPUs, gloo between
hosts), or through shared memory between CPU ranks of one host (shm_collectives.py)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# A rank waits this long in a collective for the others; a dead peer is reported by the driver
# (Ray) long before, so this only bounds a hang nobody else notices.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TorchCollectives:
    """One process group of `world_size` ranks, joined at `init_method` (tcp://host:port)."""

    def __init__(self, rank: int, world_size: int, init_method: str, backend: str) -> None:
        self.rank, self.world_size = rank, world_size
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def create_collectives(rank: int, world_size: int, device: str, init_method: str | None, segment_name: str | None):
    """Shared memory where the ranks have a segment (CPU processes of one host), else torch.distributed."""
    if segment_name is not None:
        from engine.distributed.shm_collectives import SharedMemoryCollectives

        return SharedMemoryCollectives(rank, world_size, segment_name)
    return TorchCollectives(rank, world_size, init_method, backend_for(device))
