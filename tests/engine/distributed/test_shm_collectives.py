"""The shared-memory collectives between CPU ranks of one host, against plain sums and
concatenations on fresh random tensors: several dtypes, a message larger than a slot (chunked),
many calls in a row (the two buffers reused), the same bits on every rank."""
import uuid

import pytest
import torch
import torch.multiprocessing as mp

from engine.distributed import shm_collectives
from engine.distributed.shm_collectives import SharedMemoryCollectives

pytestmark = pytest.mark.tp

WORLD_SIZE = 3
SHAPES = [(1, 576), (7, 96), (3, shm_collectives.SLOT_BYTES // 4 + 5)]  # the last one goes in chunks
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rank_tensor(rank: int, shape, dtype, call: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def run_rank(rank: int, name: str, results) -> None:
    collectives = SharedMemoryCollectives(rank, WORLD_SIZE, name)
    outputs = []
    for call, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES):
        outputs.append(collectives.all_reduce(rank_tensor(rank, shape, dtype, call)))
        outputs.append(collectives.all_gather_columns(rank_tensor(rank, shape, dtype, call)))
    results[rank] = outputs
    collectives.close()


def test_all_reduce_and_all_gather_across_processes():
    results = mp.Manager().dict()
    name = f"tandem-test-{uuid.uuid4().hex[:12]}"
    mp.start_processes(run_rank, args=(name, results), nprocs=WORLD_SIZE, start_method="spawn")
    for call, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES):
        parts = [rank_tensor(rank, shape, dtype, call) for rank in range(WORLD_SIZE)]
        expected_sum = parts[0].clone()
        for part in parts[1:]:
            expected_sum += part  # in rank order, as every rank sums
        for rank in range(WORLD_SIZE):
            reduced, gathered = results[rank][2 * call], results[rank][2 * call + 1]
            assert torch.equal(reduced, expected_sum), (shape, dtype, rank)
            assert torch.equal(gathered, torch.cat(parts, dim=-1)), (shape, dtype, rank)
