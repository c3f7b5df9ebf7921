"""The cost-table profiler and its cache, on a tiny random model with the quick grid.

Times are never compared with expectations (they vary by machine and load); the tests check the
tables' shapes and sanity, that the cost model reproduces the measured points, and that a cached
profile is used for exactly its own key.
"""
import dataclasses
import json
import math
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from engine.attention import DecodeAttentionBackend, create_decode_backend
from engine.model_config import ModelConfig
from engine.model import LlamaModel
from engine.profiling import ProfileGrid, profile_costs
from engine.profiling.cache import (
    CACHE_DIR_ENV,
    PROFILE_FORMAT_VERSION,
    ProfileKey,
    host_cpu_model,
    load_cached,
    load_or_profile,
    profile_path,
)
from engine.device.queues import InlineQueue, WorkerThreadQueue
from engine.weights import create_loader, global_shapes, layer_shapes
from engine.weights.safetensors_loader import layer_tensor_name
from scheduler.planning.cost_model import TableCostModel

BLOCK_SIZE = 4
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
GLOBAL_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def write_checkpoint(directory, seed=0):
    """A tiny HF safetensors checkpoint (config.json + model.safetensors) of random weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY))
    config = ModelConfig.from_hf_dict(TINY)
    gen = torch.Generator().manual_seed(seed)
    tensors = {GLOBAL_NAMES[k]: torch.randn(shape, generator=gen) * 0.05 for k, shape in global_shapes(config).items()}
    for layer in range(config.num_layers):
        for key, shape in layer_shapes(config).items():
            tensors[layer_tensor_name(layer, key)] = torch.randn(shape, generator=gen) * 0.05
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def build_model(checkpoint, dtype=torch.float32):
    loader = create_loader(str(checkpoint), "safetensors")
    return LlamaModel(loader.config, loader, dtype, "cpu", max_model_len=128,
                      decode_backend=create_decode_backend("auto", "cpu"))


def run_profile(model, gpu, dtype=torch.float32, grid=None, weight_stats=None):
    return profile_costs(model, gpu, model.decode_backend, create_decode_backend("auto", "cpu"),
                         block_size=BLOCK_SIZE, dtype=dtype, grid=grid or ProfileGrid.quick(), progress=False,
                         weight_stats=weight_stats)


@pytest.fixture(scope="module")
def tables(checkpoint):
    return run_profile(build_model(checkpoint), InlineQueue("cpu"))


def all_times(model: TableCostModel):
    curves = (model.linear_curve, model.prefill_curve, model.gpu_decode_curve, model.head_curve)
    grid_times = [z for row in model.cpu_decode_grid.zs for z in row]
    return [y for c in curves for y in c.ys] + grid_times + [model.swap_per_block]


def check_tables(model: TableCostModel, grid: ProfileGrid, num_layers: int):
    assert model.num_layers == num_layers
    assert model.linear_curve.xs == tuple(map(float, grid.linear_tokens))
    assert model.prefill_curve.xs == tuple(map(float, grid.prefill_lens))
    assert model.gpu_decode_curve.xs == tuple(map(float, grid.gpu_decode_context_tokens))
    assert model.head_curve.xs == tuple(map(float, grid.head_rows))
    cpu = model.cpu_decode_grid
    assert cpu.xs == tuple(map(float, grid.cpu_decode_batch_sizes))
    assert cpu.ys == tuple(map(float, grid.cpu_decode_context_tokens))
    assert len(cpu.zs) == len(cpu.xs) and all(len(row) == len(cpu.ys) for row in cpu.zs)
    times = all_times(model)
    assert all(math.isfinite(t) and t > 0 for t in times), times


# ---- measuring --------------------------------------------------------------------------------
def test_tables_have_the_grid_shape_and_positive_finite_times(tables):
    check_tables(tables, ProfileGrid.quick(), TINY["num_hidden_layers"])


class ThreadNotingQueue(WorkerThreadQueue):
    """The testbed's queue, noting the thread that runs each piece of GPU work."""

    def __init__(self):
        super().__init__(cores=None, num_threads=1, name="test-gpu")
        self.threads = []

    def submit(self, fn):
        def noted():
            self.threads.append(threading.current_thread().name)
            return fn()
        return super().submit(noted)


class ThreadNotingDecode(DecodeAttentionBackend):
    """A real decode backend, noting the thread of each call."""

    name = "noting"

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def forward(self, *args):
        self.threads.append(threading.current_thread().name)
        return self.inner.forward(*args)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="the testbed's GPU thread needs a core of its own")
def test_profiles_on_the_testbed_worker_thread(checkpoint, capsys):
    queue = ThreadNotingQueue()
    try:
        model = build_model(checkpoint)
        gpu_decode = ThreadNotingDecode(model.decode_backend)
        cpu_decode = ThreadNotingDecode(create_decode_backend("auto", "cpu"))
        grid = ProfileGrid.quick()
        tables = profile_costs(model, queue, gpu_decode, cpu_decode, block_size=BLOCK_SIZE, dtype=torch.float32,
                               grid=grid, progress=True)
        check_tables(tables, grid, TINY["num_hidden_layers"])
        queue.synchronize()  # the queue still takes work afterwards
    finally:
        queue.close()
    runs = grid.warmup + grid.repetitions
    num_cells = len(grid.cpu_decode_batch_sizes) * len(grid.cpu_decode_context_tokens)
    # GPU work (the swap copies included) on the GPU thread, CPU attention on the caller's
    assert len(queue.threads) >= runs * (grid.num_points - num_cells)
    assert set(queue.threads) == {"test-gpu"}
    assert gpu_decode.threads and set(gpu_decode.threads) == {"test-gpu"}
    assert cpu_decode.threads == [threading.current_thread().name] * (runs * num_cells)
    assert "profiling costs" in capsys.readouterr().err


def test_profiles_bfloat16(checkpoint):
    tables = run_profile(build_model(checkpoint, torch.bfloat16), InlineQueue("cpu"), dtype=torch.bfloat16)
    check_tables(tables, ProfileGrid.quick(), TINY["num_hidden_layers"])


def test_cost_model_reproduces_measured_points_and_interpolates_between(tables):
    grid = ProfileGrid.quick()
    for x, y in zip(grid.linear_tokens, tables.linear_curve.ys):
        assert tables.linear(x) == pytest.approx(y)
    for x, y in zip(grid.prefill_lens, tables.prefill_curve.ys):
        assert tables.prefill_attention([x]) == pytest.approx(y)
        assert tables.prefill_attention([x, x]) == pytest.approx(2 * y)  # per sequence, summed
    for x, y in zip(grid.gpu_decode_context_tokens, tables.gpu_decode_curve.ys):
        assert tables.gpu_decode_attention(3, x) == pytest.approx(y)
    for x, y in zip(grid.head_rows, tables.head_curve.ys):
        assert tables.head(x) == pytest.approx(y)
    batches, totals = grid.cpu_decode_batch_sizes, grid.cpu_decode_context_tokens
    zs = tables.cpu_decode_grid.zs
    for i, batch in enumerate(batches):
        for j, total in enumerate(totals):
            assert tables.cpu_decode_attention(batch, total) == pytest.approx(zs[i][j])
    # halfway along both axes: bilinear is the corners' mean
    mid_batch, mid_total = (batches[0] + batches[1]) / 2, (totals[0] + totals[1]) / 2
    corners = (zs[0][0] + zs[0][1] + zs[1][0] + zs[1][1]) / 4
    assert tables.cpu_decode_attention(mid_batch, mid_total) == pytest.approx(corners)
    # halfway between two token counts: the chord's midpoint
    (x0, x1), (y0, y1) = grid.linear_tokens[:2], tables.linear_curve.ys[:2]
    assert tables.linear((x0 + x1) / 2) == pytest.approx((y0 + y1) / 2)
    assert tables.swap(10) == pytest.approx(10 * tables.swap_per_block)


def test_grid_validation():
    with pytest.raises(ValueError, match="strictly increasing"):
        ProfileGrid(linear_tokens=(4, 2))
    with pytest.raises(ValueError, match="positive ints"):
        ProfileGrid(head_rows=(0, 4))
    with pytest.raises(ValueError, match="token per sequence"):
        ProfileGrid(cpu_decode_batch_sizes=(1, 128), cpu_decode_context_tokens=(64, 1024))
    with pytest.raises(ValueError, match="repetitions"):
        ProfileGrid(repetitions=0)
    assert ProfileGrid.quick().num_points < ProfileGrid().num_points


# ---- the cache --------------------------------------------------------------------------------
def make_key(checkpoint, **overrides):
    settings = dict(model=str(checkpoint), load_format="auto", dtype=torch.float32, device="testbed",
                    gpu_threads=1, cpu_attention_threads=1, block_size=BLOCK_SIZE)
    return ProfileKey.create(**{**settings, **overrides})


class Builds:
    """A profile builder that counts its calls and returns the given tables."""

    def __init__(self, tables):
        self.tables, self.calls = tables, 0

    def __call__(self):
        self.calls += 1
        return self.tables


def test_key_names_machine_model_and_settings(checkpoint):
    key = make_key(checkpoint)
    assert key.model == str(checkpoint.resolve()) and key.load_format == "safetensors"
    assert key.model_bytes == sum((checkpoint / f).stat().st_size for f in ("config.json", "model.safetensors"))
    assert key.dtype == "float32" and key.cpu_model == host_cpu_model() and key.cpu_model
    assert key.format_version == PROFILE_FORMAT_VERSION
    assert len(key.digest) == 16 and int(key.digest, 16) >= 0
    assert make_key(checkpoint) == key and make_key(checkpoint).digest == key.digest
    dummy = ProfileKey.create(model="smollm2-135m", load_format="dummy", dtype=torch.bfloat16, device="cpu",
                              gpu_threads=1, cpu_attention_threads=2, block_size=16)
    assert dummy.model == "dummy:smollm2-135m" and dummy.model_bytes == 0
    with pytest.raises(ValueError, match="cpu_attention_threads"):
        make_key(checkpoint, cpu_attention_threads=0)


def test_cache_round_trip(tables, checkpoint, tmp_path):
    key, build = make_key(checkpoint), Builds(tables)
    assert load_cached(key, tmp_path) is None
    assert load_or_profile(key, build, tmp_path) is tables and build.calls == 1
    assert profile_path(key, tmp_path).is_file()
    again = load_or_profile(key, build, tmp_path)
    assert build.calls == 1
    assert again == tables and again.to_dict() == tables.to_dict()


def test_cache_dir_from_environment(tables, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "from-env"))
    key = make_key(checkpoint)
    load_or_profile(key, Builds(tables))
    assert profile_path(key) == tmp_path / "from-env" / "profiles" / f"{key.digest}.json"
    assert profile_path(key).is_file()


@pytest.mark.parametrize("change", ["dtype", "gpu_threads", "cpu_attention_threads", "cpu_model",
                                    "device", "block_size"])
def test_another_key_misses(tables, checkpoint, tmp_path, change):
    key = make_key(checkpoint)
    load_or_profile(key, Builds(tables), tmp_path)
    other = {
        "dtype": lambda: make_key(checkpoint, dtype=torch.bfloat16),
        "gpu_threads": lambda: make_key(checkpoint, gpu_threads=2),
        "cpu_attention_threads": lambda: make_key(checkpoint, cpu_attention_threads=2),
        "cpu_model": lambda: dataclasses.replace(key, cpu_model=key.cpu_model + " (another host)"),
        "device": lambda: make_key(checkpoint, device="cpu"),
        "block_size": lambda: make_key(checkpoint, block_size=2 * BLOCK_SIZE),
    }[change]()
    assert other != key and other.digest != key.digest
    assert load_cached(other, tmp_path) is None
    build = Builds(tables)
    load_or_profile(other, build, tmp_path)
    assert build.calls == 1


def test_a_changed_model_file_misses(tables, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "model")
    key = make_key(checkpoint)
    load_or_profile(key, Builds(tables), tmp_path / "cache")
    assert load_cached(make_key(checkpoint), tmp_path / "cache") == tables
    weights = checkpoint / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, touched
    touched = make_key(checkpoint)
    assert touched.model_mtime_ns != key.model_mtime_ns
    assert load_cached(touched, tmp_path / "cache") is None
    with weights.open("ab") as f:  # grown
        f.write(b"\0")
    assert make_key(checkpoint).model_bytes == key.model_bytes + 1
    assert load_cached(make_key(checkpoint), tmp_path / "cache") is None


def test_a_file_holding_another_key_is_not_used(tables, checkpoint, tmp_path):
    key = make_key(checkpoint)
    stranger = dataclasses.replace(key, dtype="bfloat16")
    # e.g. copied by hand from another host, or a hash collision: the file name says `key`
    path = profile_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": stranger.to_dict(), "tables": tables.to_dict()}))
    assert load_cached(key, tmp_path) is None
    build = Builds(tables)
    load_or_profile(key, build, tmp_path)
    assert build.calls == 1
    assert json.loads(path.read_text())["key"] == key.to_dict()


@pytest.mark.parametrize("content", ["{not json", "[]", '{"key": null}', "\xff\xfe", "TABLES"])
def test_a_corrupt_file_is_profiled_again(tables, checkpoint, tmp_path, caplog, content):
    key = make_key(checkpoint)
    path = profile_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "TABLES":  # the right key, tables missing a field
        broken = tables.to_dict()
        del broken["linear"]
        path.write_text(json.dumps({"key": key.to_dict(), "tables": broken}))
    else:
        path.write_bytes(content.encode("latin-1"))
    assert load_cached(key, tmp_path) is None
    build = Builds(tables)
    assert load_or_profile(key, build, tmp_path) is tables and build.calls == 1
    assert load_cached(key, tmp_path) == tables
    if content != '{"key": null}':  # a foreign key is only noted; unreadable files are warned about
        assert any("profiling again" in r.getMessage() for r in caplog.records)


def test_atomic_write_leaves_no_temp_files(tables, checkpoint, tmp_path, monkeypatch):
    keys = [make_key(checkpoint), make_key(checkpoint, dtype=torch.bfloat16)]
    for key in keys:
        load_or_profile(key, Builds(tables), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k.digest}.json" for k in keys)

    # the rename fails (say, the disk filled): no half file, no temp file, the tables still serve
    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    third = make_key(checkpoint, block_size=2 * BLOCK_SIZE)
    assert load_or_profile(third, Builds(tables), tmp_path) is tables
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k.digest}.json" for k in keys)


def test_linear_table_of_a_streamed_model_is_its_compute_alone(checkpoint, tmp_path):
    """Layers streamed from host memory and disk: the profiler goes through the layer store
    (acquire/release, as a forward does) and subtracts the time it waited for weights, so the
    linear table holds compute only (the cost model adds the transfers itself). Each load here is
    slowed by 30 ms, far above the tiny model's compute."""
    import time

    from engine.device.cores import CoreAssignment
    from engine.offload.layer_store import create_layer_store
    from engine.weights.layer_files import ConversionKey, LayerFiles
    from scheduler.planning import TIER_DISK, TIER_HOST, ForwardTimeline, MemoryBreakdown, ThroughputEstimate
    from scheduler.planning import WeightPlacement
    from scheduler.planning.layer_plan import ModelPlan

    loader = create_loader(str(checkpoint), "safetensors")
    tiers = (TIER_HOST, TIER_DISK, TIER_HOST)
    placement = WeightPlacement("cpu", tiers, "performance", 2, 0, MemoryBreakdown(*[0] * 9),
                                ThroughputEstimate(1, 1, ForwardTimeline(1.0, 1.0, 1.0, 0.0)), {})
    files = LayerFiles(tmp_path, ConversionKey.create(loader.source, torch.float32, "none", torch.device("cpu")), 3)
    store = create_layer_store(ModelPlan.compose(3, placement), torch.device("cpu"), CoreAssignment.for_device("cpu"),
                               files, 2, None, 0)
    copy = store.copy_engine.copy

    def slow_copy(dst, src):
        time.sleep(0.03 * src.numel() / store.ring.items[0].image.nbytes)
        copy(dst, src)
    store.copy_engine.copy = slow_copy
    model = LlamaModel(loader.config, loader, torch.float32, "cpu", max_model_len=128,
                       decode_backend=create_decode_backend("auto", "cpu"), layer_store=store)
    try:
        tables = run_profile(model, InlineQueue("cpu"), weight_stats=store.stats)
        check_tables(tables, ProfileGrid.quick(), TINY["num_hidden_layers"])
        # compute alone, not the 30 ms loads (at one token: the C++ GEMV, about a millisecond; the
        # larger points go through torch's thread pool, whose time swings with the host's load)
        assert tables.linear_curve(1) < 0.01
        assert store.stats.stall_s > 0.03  # the loads were waited for
    finally:
        store.close()
