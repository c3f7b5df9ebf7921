"""Layer files that can be trusted (engine/weights/layer_files.py, layer_file_format.py,
file_writes.py): a truncated, bit-flipped or other model's file is never used (serve's path writes
it again from the source weights, with a warning naming it; without the source it is refused by
name), an interrupted write leaves no complete-looking file, and a write that does not fit the
filesystem is refused before anything is written, with the bytes missing; on a real 8 MiB tmpfs
(as root) too, where a write that still hits ENOSPC removes its temporary file."""
import dataclasses
import errno
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from engine.device.cores import CoreAssignment
from engine.offload.layer_store import create_layer_store, open_layer_files
from engine.model_config import ModelConfig
from engine.quant import create_linear_method
from engine.weights import WeightLoadError, create_loader, layer_shapes
from engine.weights import file_writes
from engine.offload.convert import build_host_layer, convert, verify
from engine.weights.file_writes import TMP_SUFFIX, peak_bytes
from engine.weights.layer_files import ConversionKey, LayerFiles, room_bytes
from scheduler.planning import TIER_DISK, ForwardTimeline, MemoryBreakdown, ThroughputEstimate, WeightPlacement
from scheduler.planning.layer_plan import ModelPlan
from tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")
DENSE = create_linear_method("dense")
CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=128, tie_word_embeddings=True, attention_bias=False)
KEY = ConversionKey.create("test", torch.float32, "none", CPU)
DAMAGES = ["truncated", "bit flipped", "other model", "other layer", "headerless"]


# ---- helpers ------------------------------------------------------------------------------------
def loaded_layers(seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{key: torch.randn(shape, generator=generator) for key, shape in layer_shapes(CONFIG).items()}
            for _ in range(CONFIG.num_layers)]


def disk_plan(layer_bytes: int = 0) -> ModelPlan:
    """Every layer placed on disk, each of `layer_bytes` as the planner counts them."""
    placement = WeightPlacement("disk", (TIER_DISK,) * CONFIG.num_layers, "performance", 2, layer_bytes,
                                MemoryBreakdown(*[0] * 9), ThroughputEstimate(1, 1, ForwardTimeline(1.0, 1.0, 1.0, 0.0)),
                                {TIER_DISK: 0.0})
    return ModelPlan.compose(CONFIG.num_layers, placement)


def disk_store(directory: Path, key: ConversionKey = KEY, seed: int = 0):
    """serve's path: every layer placed on disk, built from its (source) weights; a file is reused
    or written as the ring decides. -> (store, its layers)"""
    files = LayerFiles(directory, key, CONFIG.num_layers)
    store = create_layer_store(disk_plan(), CPU, CoreAssignment.for_device("cpu"), files, num_io_threads=2)
    layers = [store.build(i, w, DENSE, torch.float32) for i, w in enumerate(loaded_layers(seed))]
    store.start()
    return store, layers


def streamed_outputs(directory: Path, key: ConversionKey = KEY) -> list[torch.Tensor]:
    """Each layer's QKV output on a fixed input, its weights read from its file by the ring."""
    store, layers = disk_store(directory, key)
    x = torch.ones(2, CONFIG.hidden_size)
    try:
        outputs = []
        for index, layer in enumerate(layers):
            store.acquire(index)
            outputs.append(layer.qkv.apply(x))
            store.release(index)
        return outputs
    finally:
        store.close()


def damage(files: LayerFiles, index: int, how: str) -> None:
    """Damage layer `index`'s file as a disk, a crash or a careless copy would."""
    path = files.path(index)
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 4096)
    elif how == "bit flipped":
        with open(path, "r+b") as file:
            file.seek(files.check(index).payload_offset + 1000)
            byte = file.read(1)[0]
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte ^ 0x10]))
    elif how == "other model":
        other = LayerFiles(files.directory / "other", dataclasses.replace(files.key, source="another-model"), 2)
        other.write_layer(index, files.check(index).header.image, read_payload(files, index))
        os.replace(other.path(index), path)
    elif how == "other layer":
        os.replace(files.path(1 - index), path)
    elif how == "headerless":  # format 1: the bare image
        path.write_bytes(read_payload(files, index).numpy().tobytes())


def read_payload(files: LayerFiles, index: int) -> torch.Tensor:
    check = files.check(index)
    data = files.path(index).read_bytes()[check.payload_offset:]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def written_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


# ---- damaged files ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", DAMAGES)
def test_serve_writes_a_damaged_file_again_from_the_source_weights(tmp_path, caplog, how):
    expected = streamed_outputs(tmp_path)
    damage(LayerFiles(tmp_path, KEY, 2), 0, how)
    assert not LayerFiles(tmp_path, KEY, 2).check(0).intact
    with caplog.at_level(logging.WARNING, logger="engine.weights.layer_files"):
        got = streamed_outputs(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(tmp_path / "layer-0000.bin") in w and "writing it again" in w for w in warnings), warnings
    assert not any("layer-0001.bin" in w for w in warnings) or how == "other layer"
    assert LayerFiles(tmp_path, KEY, 2).check(0).intact


@pytest.mark.parametrize("how, problem", [("truncated", "truncated"), ("bit flipped", "CRC-32"),
                                          ("other model", "another conversion"), ("other layer", "holds layer 1"),
                                          ("headerless", "no layer-file header")])
def test_without_the_source_a_damaged_file_is_refused_by_name(tmp_path, how, problem):
    streamed_outputs(tmp_path)
    files = LayerFiles(tmp_path, KEY, 2)
    damage(files, 0, how)
    files = LayerFiles(tmp_path, KEY, 2)
    with pytest.raises(WeightLoadError) as info:
        verify(files)
    message = str(info.value)
    assert f"{tmp_path / 'layer-0000.bin'}: " in message and problem in message
    assert "tandem convert" in message
    with pytest.raises(WeightLoadError, match=re.escape(str(files.path(0)))):
        files.payload_offset(0)  # the ring's way in refuses it too


def test_a_file_with_another_layout_is_not_used(tmp_path, caplog):
    """Same model and key, another image (e.g. another tandem's layout): written again."""
    streamed_outputs(tmp_path)
    files = LayerFiles(tmp_path, KEY, 2)
    other = build_host_layer(None, 0, create_linear_method("int4"), torch.float32, CPU, loaded=loaded_layers()[0])
    with caplog.at_level(logging.WARNING, logger="engine.weights.layer_files"):
        assert not files.has_layer(0, other.image)
    assert "another image layout" in caplog.text


# ---- interrupted writes -------------------------------------------------------------------------
@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(errno.EIO, "Input/output error")])
def test_an_interrupted_write_leaves_no_complete_looking_file(tmp_path, monkeypatch, failure):
    """The second pwrite of layer 1 fails (the header went, the payload did not): no layer-0001.bin,
    no temporary file, layer 0 intact."""
    streamed_outputs(tmp_path)
    os.unlink(tmp_path / "layer-0001.bin")
    files = LayerFiles(tmp_path, KEY, 2)
    calls = []

    def failing_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise failure
        return os.pwrite(fd, data, offset)
    monkeypatch.setattr(file_writes.os, "pwrite", failing_pwrite)
    layer = build_host_layer(None, 1, DENSE, torch.float32, CPU, loaded=loaded_layers()[1])
    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else WeightLoadError) as info:
        files.write_layer(1, layer.image, layer.data)
    monkeypatch.undo()
    if isinstance(failure, OSError):
        assert str(files.path(1)) in str(info.value) and "nothing partial was left" in str(info.value)
    assert written_files(tmp_path) == ["layer-0000.bin", "manifest.json"]
    assert LayerFiles(tmp_path, KEY, 2).check(0).intact


def test_a_crash_mid_write_leaves_only_a_temporary_file_which_the_next_start_removes(tmp_path):
    streamed_outputs(tmp_path)
    good = (tmp_path / "layer-0001.bin").read_bytes()
    (tmp_path / f"layer-0001.bin{TMP_SUFFIX}").write_bytes(good[:len(good) // 2])  # a killed rewrite
    (tmp_path / f"manifest.json{TMP_SUFFIX}").write_text("{")
    files = LayerFiles(tmp_path, KEY, 2)
    assert written_files(tmp_path) == ["layer-0000.bin", "layer-0001.bin", "manifest.json"]
    assert files.check(1).intact and (tmp_path / "layer-0001.bin").read_bytes() == good


# ---- free space ---------------------------------------------------------------------------------
def test_peak_bytes_counts_a_new_file_beside_the_one_it_replaces():
    assert peak_bytes([]) == 0
    assert peak_bytes([(10, 0), (10, 0)]) == 20
    assert peak_bytes([(10, 8), (10, 8), (10, 8)]) == 14  # grows 2 a file, each new one beside its old one


def test_the_space_check_refuses_before_writing_with_the_numbers(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)
    loader = create_loader(str(gguf))
    directory = tmp_path / "offload"
    files = LayerFiles(directory, ConversionKey.create(loader.source, torch.float32, "none", CPU), 2)
    image_bytes = build_host_layer(loader, 0, DENSE, torch.float32, CPU).image.nbytes
    needed = 2 * (4096 + image_bytes)
    monkeypatch.setattr(file_writes, "free_bytes", lambda directory: needed - 1)
    with pytest.raises(WeightLoadError) as info:
        convert(loader, files, DENSE, torch.float32, CPU)
    message = str(info.value)
    assert f"offload directory {directory}" in message and "2 layer files to write (layers 0-1)" in message
    assert f"({needed} bytes)" in message and f"({needed - 1} bytes) free" in message
    assert "(1 bytes) missing" in message and "--offload-dir" in message
    assert written_files(directory) == []
    monkeypatch.setattr(file_writes, "free_bytes", lambda directory: needed)
    assert convert(loader, LayerFiles(directory, files.key, 2), DENSE, torch.float32, CPU) == (2, 0)


# ---- a real small filesystem --------------------------------------------------------------------
SMALL_FS_BYTES = 8 * 2**20


@pytest.fixture
def small_filesystem(tmp_path):
    """An 8 MiB tmpfs (a loop-mounted ext2 image where tmpfs is refused), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    problem = _mount_small(tmp_path, mount_point)
    if problem:
        pytest.skip(f"cannot mount a small filesystem here: {problem}")
    try:
        yield mount_point
    finally:  # lazily where a file is still open, so no mount outlives the test
        if subprocess.run(["umount", str(mount_point)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=True)


def _mount_small(tmp_path: Path, mount_point: Path) -> str:
    """Mount an 8 MiB filesystem on `mount_point`. -> "" or why it could not."""
    tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_BYTES}", "tmpfs", str(mount_point)],
                           capture_output=True, text=True)
    if tmpfs.returncode == 0:
        return ""
    image = tmp_path / "small.img"
    with open(image, "wb") as file:
        file.truncate(SMALL_FS_BYTES)
    for command in (["mkfs.ext2", "-q", "-F", str(image)], ["mount", "-o", "loop", str(image), str(mount_point)]):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            return f"tmpfs: {tmpfs.stderr.strip()}; loop mount: {result.stderr.strip()}"
    return ""


def fill(directory: Path, leave_bytes: int) -> None:
    """A ballast file taking all but about `leave_bytes` of the filesystem's free space."""
    free = file_writes.free_bytes(directory)
    with open(directory / "ballast", "wb") as file:
        file.write(b"\0" * (free - leave_bytes))
        file.flush()
        os.fsync(file.fileno())


@pytest.fixture
def tiny_model(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf)  # float32: 2 layers of 2.25 MiB
    return create_loader(str(gguf))


def test_convert_on_a_full_filesystem_is_refused_with_the_bytes_missing(small_filesystem, tiny_model):
    fill(small_filesystem, 2**20)
    key = ConversionKey.create(tiny_model.source, torch.float32, "none", CPU)
    directory = small_filesystem / "offload"
    free = file_writes.free_bytes(small_filesystem)
    with pytest.raises(WeightLoadError) as info:
        convert(tiny_model, LayerFiles(directory, key, 2), DENSE, torch.float32, CPU)
    needed = int(re.search(r"need [\d.]+ GiB \((\d+) bytes\)", str(info.value)).group(1))
    assert f"({free} bytes) free: " in str(info.value) and f"({needed - free} bytes) missing" in str(info.value)
    assert needed > free and written_files(directory) == []


def test_a_write_that_hits_enospc_midway_removes_its_temporary_file(small_filesystem, tiny_model, monkeypatch):
    """The space check passed (another writer took the space after it, simulated): layer 0 fits,
    layer 1 hits ENOSPC halfway; its temporary file is gone and layer 0 is intact."""
    key = ConversionKey.create(tiny_model.source, torch.float32, "none", CPU)
    directory = small_filesystem / "offload"
    layer_bytes = build_host_layer(tiny_model, 0, DENSE, torch.float32, CPU).image.nbytes
    fill(small_filesystem, int(1.5 * layer_bytes))
    monkeypatch.setattr(file_writes, "free_bytes", lambda directory: 2**40)
    with pytest.raises(WeightLoadError) as info:
        convert(tiny_model, LayerFiles(directory, key, 2), DENSE, torch.float32, CPU)
    message = str(info.value)
    assert str(directory / "layer-0001.bin") in message and "ENOSPC" in message
    assert "nothing partial was left" in message and "--offload-dir" in message
    assert written_files(directory) == ["layer-0000.bin", "manifest.json"]
    files = LayerFiles(directory, key, 2)
    assert files.check(0).intact and not files.check(1).exists


def test_serve_checks_its_files_and_their_space_before_loading(small_filesystem):
    """serve's start (open_layer_files): intact files are reused on a full filesystem; a damaged
    one is refused there before anything loads, needing room for its new file beside the old."""
    directory = small_filesystem / "offload"
    layer_bytes = build_host_layer(None, 0, DENSE, torch.float32, CPU, loaded=loaded_layers()[0]).image.nbytes
    fill(small_filesystem, layer_bytes)
    with pytest.raises(WeightLoadError, match=r"2 layer files to write \(layers 0-1\)"):
        open_layer_files(disk_plan(layer_bytes), str(directory), KEY, CONFIG.num_layers)
    os.unlink(small_filesystem / "ballast")
    streamed_outputs(directory)  # the files written
    fill(small_filesystem, 0)
    assert room_bytes(directory) == sum(p.stat().st_size for p in directory.glob("layer-*.bin"))
    open_layer_files(disk_plan(layer_bytes), str(directory), KEY, CONFIG.num_layers)  # reused: nothing to write
    damage(LayerFiles(directory, KEY, 2), 1, "bit flipped")
    with pytest.raises(WeightLoadError) as info:
        open_layer_files(disk_plan(layer_bytes), str(directory), KEY, CONFIG.num_layers)
    free = file_writes.free_bytes(directory)
    assert "1 layer files to write (layers 1)" in str(info.value)
    assert f"need 0.00 GiB ({4096 + layer_bytes} bytes)" in str(info.value)
    assert f"({4096 + layer_bytes - free} bytes) missing" in str(info.value)


def test_the_disk_probe_fits_itself_to_a_nearly_full_filesystem(small_filesystem):
    """The planner's disk-read probe writes at most half the free space, and leaves nothing."""
    from engine.profiling.streaming_probe import measure_disk_bytes_per_s
    from engine.weights.direct_io import DirectReader

    fill(small_filesystem, 2**20)
    directory = small_filesystem / "offload"
    reader = DirectReader(1)
    try:
        bytes_per_s, _ = measure_disk_bytes_per_s(directory, reader)
    finally:
        reader.close()
    assert bytes_per_s > 0 and written_files(directory) == []
