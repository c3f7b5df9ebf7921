"""The host KV pool's allocation: zeroed, 2 MiB-aligned, advised onto transparent huge pages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from scheduler.planning.kv_format import kv_format
from engine.model_config import ModelConfig
from engine.kv import HUGE_PAGE_BYTES, KVCache, host_zeros
from engine.weights import EMBEDDED_MODEL

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_flags(address: int) -> list[str]:
    """VmFlags of the mapping holding `address` in /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def thp_available() -> bool:
    return sys.platform.startswith("linux") and THP_ENABLED.exists() and "[never]" not in THP_ENABLED.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_zeros_is_a_zeroed_writable_aligned_tensor(dtype):
    shape = (3, 5, 2, 16, 128 * 64)  # 3-15 MiB: not a multiple of the huge page
    tensor = host_zeros(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.any()
    tensor[-1, -1, -1, -1, -1] = 1.5  # the last element lies inside the buffer
    tensor[0, 0, 0, 0, 0] = -2.0
    assert tensor.sum().item() == -0.5


def test_small_host_tensors_take_plain_pages():
    tensor = host_zeros((4, 8), torch.float32)
    assert tensor.shape == (4, 8) and not tensor.any()


@pytest.mark.skipif(not thp_available(), reason="no transparent huge pages on this host")
def test_host_pool_is_advised_onto_huge_pages():
    config = ModelConfig.from_preset(EMBEDDED_MODEL)  # 30 layers, 3 kv heads of 64
    cache = KVCache(config, num_blocks=32, block_size=16, dtype=torch.float32)  # 11 MiB per tensor
    for tensor in (cache.key, cache.value):
        assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
        assert "hg" in mapping_flags(tensor.data_ptr())  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took


def test_bytes_per_block_is_what_the_pools_take():
    # Llama-3.1-8B in bf16: 16 tokens x 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert KVCache.bytes_per_block(ModelConfig.from_preset("llama-3.1-8b"), 16, kv_format("bfloat16")) == 16 * 128 * 1024
    config = ModelConfig.from_preset(EMBEDDED_MODEL)
    cache = KVCache(config, num_blocks=3, block_size=4, dtype=torch.float16)
    assert cache.key.nbytes + cache.value.nbytes == 3 * KVCache.bytes_per_block(config, 4, kv_format("float16"))
