"""KV cache formats: the quantized unit layout's reference (kernels/kv_quant.py), the pools built in
each format (engine/kv/layouts.py), and that the planners' bytes agree with the pools'."""
import pytest
import torch

from engine.attention.decode import TorchPagedDecode
from engine.config import CacheConfig
from engine.kv import KVCache, TwoTierKVCache
from engine.kv.layouts import RANDOM_TILE_ELEMENTS, create_layout, fill_tiled, resolve_kv_format
from engine.model_config import ConfigError
from engine.weights import EMBEDDED_MODEL, create_loader
from kernels import kv_quant
from kernels.cpu import reference
from scheduler.planning.kv_format import KV_FORMATS, KV_GROUP_SIZE, kv_format

FORMATS = list(KV_FORMATS)
QUANTIZED = ["int8", "int4", "k8v4"]


@pytest.fixture(scope="module")
def config():
    return create_loader(EMBEDDED_MODEL).config


def test_the_planners_group_size_is_the_layouts():
    assert KV_GROUP_SIZE == kv_quant.GROUP_SIZE


def test_the_planners_quantized_formats_are_the_layouts():
    # declared twice (the planners import no torch), so they must agree: names, key and value bits
    planned = {f.name: (f.key_bits, f.value_bits) for f in KV_FORMATS.values() if f.quantized}
    assert planned == kv_quant.FORMAT_BITS and set(kv_quant.FORMAT_CODES) == set(planned)


@pytest.mark.parametrize("name", FORMATS)
def test_block_bytes_are_what_the_pools_allocate(config, name):
    cache = KVCache(config, 7, 16, torch.float32, kv_cache_dtype=name)
    allocated = (cache.key.nbytes + cache.value.nbytes) // 7
    assert KVCache.bytes_per_block(config, 16, kv_format(name)) == allocated


def test_quantized_formats_hold_the_sequences_the_issue_asks():
    assert 2 / kv_format("int8").element_bytes >= 1.9 and 2 / kv_format("int4").element_bytes >= 3.5
    assert 2 / kv_format("k8v4").element_bytes >= 2.4


def test_k8v4_keys_are_int8_units_and_values_int4_units():
    layout = kv_quant.layout_for("k8v4", 128, 16)
    assert layout.key == kv_quant.layout_for("int8", 128, 16).key
    assert layout.value == kv_quant.layout_for("int4", 128, 16).value
    # a token's K and V bytes per head: 128 + 2 * 2 (int8) and 64 + 2 * 2 * 2 (int4)
    assert kv_format("k8v4").element_bytes * 2 * 128 == 132 + 72


def test_auto_is_the_compute_dtype():
    assert resolve_kv_format("auto", torch.bfloat16).name == "bfloat16"
    assert resolve_kv_format("int4", torch.float32).name == "int4"


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_error_is_within_half_a_step(gen, bits):
    x = torch.randn(33, 3, 128, generator=gen) * torch.rand(33, 3, 1, generator=gen) * 10
    codes, scales, mins = kv_quant.quantize(x, bits)
    error = (kv_quant.dequantize(codes, scales, mins) - x).abs().unflatten(-1, (-1, kv_quant.GROUP_SIZE))
    # half a step, plus the fp16 rounding of the minimum
    slack = 0.5 * scales.float() + (0 if mins is None else (mins.float() - x.unflatten(-1, (-1, 64)).amin(-1)).abs())
    assert (error <= slack[..., None] * 1.001 + 1e-6).all()


def test_codes_round_half_to_even_and_zero_range_groups_are_zero():
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, 3.5  # scale 1: 2.5 -> 2, 3.5 -> 4
    codes, scales, _ = kv_quant.quantize(x, 8)
    assert codes[0, :3].tolist() == [127, 2, 4] and scales[1].item() == 0 and codes[1].abs().sum() == 0


def test_nibbles_and_rotation_invert(gen):
    codes = torch.randint(0, 16, (5, 128), generator=gen, dtype=torch.uint8)
    assert torch.equal(kv_quant.unpack_nibbles(kv_quant.pack_nibbles(codes)), codes)
    assert kv_quant.pack_nibbles(codes)[0, 0] == codes[0, 0] | (codes[0, 32] << 4)
    x = torch.randn(4, 128, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(kv_quant.rotate(kv_quant.rotate(x)), x)


@pytest.mark.parametrize("name", QUANTIZED)
def test_writes_land_in_their_slots_and_gather_back(config, gen, name):
    cache = KVCache(config, 6, 16, torch.float32, kv_cache_dtype=name)
    key, value = (torch.randn(20, config.num_kv_heads, config.head_dim, generator=gen) for _ in range(2))
    cache.write_blocks(3, key, value, [4, 1], start=0)
    got_key, got_value = cache.gather(3, [4, 1], 20)
    units = cache.layout.units
    torch.testing.assert_close(got_key, kv_quant.round_trip(key, units.key.bits, True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_value, kv_quant.round_trip(value, units.value.bits, False), atol=1e-5, rtol=1e-5)
    for got, rows, side in ((got_key, key, units.key), (got_value, value, units.value)):
        rms = 0.012 if side.bits == 8 else 0.2  # randn rows: steps of absmax/127, range/15
        assert (got - rows).pow(2).mean().sqrt() < rms


@pytest.mark.parametrize("name", QUANTIZED)
def test_slot_writes_and_whole_block_writes_store_the_same_bytes(config, gen, name):
    by_slots, by_blocks = (KVCache(config, 4, 16, torch.float32, kv_cache_dtype=name) for _ in range(2))
    key, value = (torch.randn(21, config.num_kv_heads, config.head_dim, generator=gen) for _ in range(2))
    positions = torch.arange(5, 26)
    table = torch.tensor([2, 0])
    by_slots.write(0, key, value, table[positions // 16], positions % 16)
    by_blocks.write_blocks(0, key, value, [2, 0], start=5)
    assert torch.equal(by_slots.key, by_blocks.key) and torch.equal(by_slots.value, by_blocks.value)


@pytest.mark.parametrize("name", QUANTIZED)
def test_swaps_move_quantized_blocks_as_they_are(config, gen, name):
    gpu, host = (KVCache(config, 5, 16, torch.float32, kv_cache_dtype=name) for _ in range(2))
    gpu.fill_random()

    class Move:
        src_blocks, dst_blocks = (1, 2, 4), (0, 1, 3)

    TwoTierKVCache(gpu, host).copy_blocks([Move], to_cpu=True)
    for pool_gpu, pool_host in ((gpu.key, host.key), (gpu.value, host.value)):
        assert torch.equal(pool_host[:, [0, 1, 3]], pool_gpu[:, [1, 2, 4]])


@pytest.mark.parametrize("name", QUANTIZED)
def test_torch_decode_reads_quantized_pools_as_the_dense_reference(config, gen, name):
    layout = create_layout(name, torch.float32, 2, 128, 16)
    key_pool, value_pool = layout.allocate(1, 9, torch.zeros)
    layout.fill_random(key_pool, value_pool)
    key_pool, value_pool = key_pool[0], value_pool[0]
    tables = torch.tensor([[3, 7, 0], [8, 1, 5]], dtype=torch.int32)
    lens = torch.tensor([21, 40], dtype=torch.int32)
    query = torch.randn(2, 6, 128, generator=gen)
    new_key, new_value = (torch.randn(2, 2, 128, generator=gen) for _ in range(2))
    got = TorchPagedDecode(layout).forward(query, key_pool, value_pool, tables, lens, 0.1, new_key, new_value)
    dense = [kv_quant.dequantize_pool(pool, layout.units.side(is_key), is_key)
             for pool, is_key in ((key_pool, True), (value_pool, False))]
    want = reference.paged_decode_attention(query, *dense, tables, lens, 0.1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_refusals_say_what_to_change():
    with pytest.raises(ConfigError, match="block_size a multiple of 16"):
        CacheConfig(block_size=8, kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8")
    assert "multiple of 64" in kv_format("int8").check_head_dim(80)
    assert kv_format("float16").check_head_dim(80) is None


def test_a_random_fill_writes_every_element_and_no_two_blocks_alike():
    pool = torch.zeros(2, 48, 2, 16, 64)  # more than one tile
    fill_tiled(pool, torch.Tensor.normal_)
    assert pool.numel() > RANDOM_TILE_ELEMENTS and bool((pool != 0).all())
    blocks = pool.flatten(0, 1).flatten(1)
    assert torch.unique(blocks, dim=0).shape[0] == blocks.shape[0]
