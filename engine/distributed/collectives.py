"""The tensor-parallel ranks' collectives: over torch.distributed (NCCL between GPUs, gloo between
hosts), or through shared memory between CPU ranks of one host (shm_collectives.py)."""
from __future__ import annotations

import fcntl
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

# A rank waits this long in a collective for the others; a dead peer is reported by the driver
# (Ray) long before, so this only bounds a hang nobody else notices.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TorchCollectives:
    """One process group of `world_size` ranks, joined at `init_method` (tcp://host:port)."""

    def __init__(self, rank: int, world_size: int, init_method: str, backend: str, node_ip: str | None) -> None:
        """`node_ip`: this rank's address in the cluster, which gloo is bound to (None: gloo's default)."""
        self.rank, self.world_size = rank, world_size
        if backend == "gloo" and node_ip is not None:
            bind_gloo_to(node_ip)
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


def bind_gloo_to(node_ip: str) -> None:
    """Gloo listens where this host's name resolves, 127.0.0.1 on many hosts, which a rank on another
    host cannot reach: bind it to the interface holding `node_ip` instead, unless GLOO_SOCKET_IFNAME
    names one already (this rank's process is its own, so its environment is too)."""
    interface = interface_holding(node_ip)
    if interface is not None:
        os.environ.setdefault(GLOO_INTERFACE_ENV, interface)


def interface_holding(address: str) -> str | None:
    """The name of the network interface whose IPv4 address is `address`; None if none (or not Linux)."""
    if not hasattr(socket, "if_nameindex"):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:  # struct ifreq: the name in 16 bytes, then a sockaddr_in whose address is at 20..24
                request = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(request[20:24]) == address:
                return name
    return None


def create_collectives(rank: int, world_size: int, device: str, init_method: str | None, segment_name: str | None,
                       node_ip: str | None = None):
    """Shared memory where the ranks have a segment (CPU processes of one host), else torch.distributed
    (gloo bound to `node_ip`, where given)."""
    if segment_name is not None:
        from engine.distributed.shm_collectives import SharedMemoryCollectives

        return SharedMemoryCollectives(rank, world_size, segment_name)
    return TorchCollectives(rank, world_size, init_method, backend_for(device), node_ip)
