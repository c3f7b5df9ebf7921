"""The pure reader behind the cpu_attention benchmark's "pattern reader" column reads exactly the
block table's (block, kv head) slices of the layers it is pointed at, on any thread count."""

import pytest
import torch

from benchmarks.kernels.cpu_attention import PatternReader


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    built = PatternReader.build(tmp_path_factory.mktemp("pattern_reader"))
    if built is None:
        pytest.skip("the pattern reader needs x86 with AVX2 and a C++ compiler")
    return built


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_reads_each_table_block_of_each_layer_once(reader, num_threads):
    generator = torch.Generator().manual_seed(num_threads)
    num_layers, num_blocks, num_kv_heads, block_size, head_dim = 3, 7, 2, 4, 16
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    # Small integers in fp32 sum exactly, in any order.
    key_cache = torch.randint(0, 4, shape, generator=generator).float()
    value_cache = torch.randint(0, 4, shape, generator=generator).float()
    block_tables = torch.randperm(num_blocks, generator=generator, dtype=torch.int32)[:6].view(2, 3).contiguous()
    reps, first_layer = 4, 2

    seconds, checksum = reader.read(key_cache, value_cache, block_tables, num_threads, reps, first_layer)

    blocks = block_tables.flatten().long()
    expected = sum((key_cache[(first_layer + call) % num_layers, blocks].sum()
                    + value_cache[(first_layer + call) % num_layers, blocks].sum()).item()
                   for call in range(reps + 1))
    assert checksum == expected
    assert seconds > 0


def test_rejects_slices_that_are_not_whole_cache_lines(reader):
    cache = torch.zeros(1, 2, 1, 3, 4)  # 48-byte (block, head) slices
    with pytest.raises(ValueError, match="64-byte"):
        reader.read(cache, cache, torch.zeros(1, 2, dtype=torch.int32), 1, 1)
