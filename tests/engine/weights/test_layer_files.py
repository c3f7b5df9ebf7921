"""Per-layer weight files (`tandem convert`) and the O_DIRECT reader: a layer read back from its
file is bit for bit the layer that was written (dense, INT4 kept packed from GGUF Q4 blocks,
Qwen2's QKV bias), reads really bypass the page cache, a filesystem refusing O_DIRECT falls back
with its reason, a matching conversion is reused and another one rewritten, and the planner
counts exactly the bytes the engine lays out."""
import errno
import os
import tempfile
from pathlib import Path

import pytest
import torch

from engine.model_config import ModelConfig
from engine.model.layer_weights import LayerWeights
from engine.quant import create_linear_method
from engine.weights import create_loader, layer_shapes
from engine.offload.convert import build_host_layer, convert
from engine.weights.direct_io import (
    IO_ALIGN_BYTES,
    DirectReader,
    aligned_empty,
    is_direct,
    open_for_reading,
    writable_memoryview,
)
from engine.weights.layer_files import ConversionKey, LayerFiles
from engine.weights.layer_image import LINEAR_NAMES, LayerImage, meta_templates
from scheduler.planning import WeightFormat, layer_image_bytes
from test_weights import save_tiny_hf
from tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")


def direct_io_dir(tmp_path: Path) -> Path:
    """A directory on a filesystem that takes O_DIRECT: tmp_path, else one under the home
    directory (tmpfs /tmp refuses it); skip where none does."""
    for parent in (tmp_path, Path.home()):
        directory = Path(tempfile.mkdtemp(dir=parent))
        probe = directory / "probe"
        probe.write_bytes(b"\0" * IO_ALIGN_BYTES)
        file = open_for_reading(probe)
        os.close(file.fd)
        probe.unlink()
        if file.direct:
            return directory
    pytest.skip("no filesystem here takes O_DIRECT")


def read_back(files: LayerFiles, index: int, reader: DirectReader) -> tuple[LayerImage, torch.Tensor]:
    image = files.verify(index)
    buffer = aligned_empty(image.nbytes)
    file = files.open(index)
    try:
        blocks = []
        reader.read(file, files.payload_offset(index), image.nbytes, buffer,
                    on_block=lambda a, b: blocks.append((a, b)))
    finally:
        os.close(file.fd)
    assert sorted(blocks)[0][0] == 0 and sum(b - a for a, b in blocks) == image.nbytes  # every block handed on
    return image, buffer


@pytest.mark.parametrize("source, quantization", [("gguf-q4_0", "int4"), ("gguf-f32", "none"),
                                                  ("safetensors-qwen2", "none"), ("safetensors-qwen2", "int4")])
def test_converted_layers_read_back_bit_for_bit(tmp_path, source, quantization):
    from gguf import GGMLQuantizationType as QType

    if source.startswith("gguf"):
        path = tmp_path / "tiny.gguf"
        write_tiny_gguf(path, qtype=QType.Q4_0 if source == "gguf-q4_0" else QType.F32)
    else:
        path = tmp_path / "hf"
        save_tiny_hf(path, "qwen2", tie=True, max_shard_size=None)
    loader = create_loader(str(path))
    linear = create_linear_method("int4" if quantization == "int4" else "dense")
    directory = direct_io_dir(tmp_path)
    files = LayerFiles(directory, ConversionKey.create(loader.source, torch.float32, quantization, CPU),
                       loader.config.num_layers)
    assert convert(loader, files, linear, torch.float32, CPU) == (loader.config.num_layers, 0)
    reader = DirectReader(num_threads=3, block_bytes=IO_ALIGN_BYTES * 4)  # several blocks per layer
    x = torch.randn(5, loader.config.hidden_size)
    for index in range(loader.config.num_layers):
        original = build_host_layer(loader, index, linear, torch.float32, CPU)
        image, buffer = read_back(files, index, reader)
        assert image == original.image and torch.equal(buffer, original.data)
        linears = original.weights.named_linears()
        bound = image.bind(meta_templates(linears), buffer)
        for name in LINEAR_NAMES:
            expected = linears[name].tensors()
            assert bound[name].tensors().keys() == expected.keys()
            assert all(torch.equal(bound[name].tensors()[k], t) for k, t in expected.items())
            if name in ("qkv", "gate_up"):  # [*, hidden] inputs
                assert torch.equal(bound[name].apply(x), linears[name].apply(x))
        if source == "gguf-q4_0" and quantization == "int4":  # kept packed, never dequantized
            assert {t.name for t in image.tensors if t.weight == "qkv"} == {"codes", "scales", "mins"}
        if source.startswith("safetensors"):
            assert any(t.name == "bias" for t in image.tensors)
    reader.close()


def test_reads_bypass_the_page_cache(tmp_path):
    """The kernel's own flag is set on the open file, and the kernel enforces it: a read into a
    buffer off the block boundary is refused (a page-cache read would take any buffer)."""
    path = direct_io_dir(tmp_path) / "layer.bin"
    path.write_bytes(os.urandom(4 * IO_ALIGN_BYTES))
    file = open_for_reading(path)
    try:
        assert file.direct and is_direct(file.fd)
        misaligned = writable_memoryview(aligned_empty(3 * IO_ALIGN_BYTES))[1:1 + IO_ALIGN_BYTES]
        with pytest.raises(OSError) as info:
            os.preadv(file.fd, [misaligned], 0)
        assert info.value.errno == errno.EINVAL
        buffer = aligned_empty(4 * IO_ALIGN_BYTES)
        DirectReader(2, IO_ALIGN_BYTES).read(file, 0, 4 * IO_ALIGN_BYTES, buffer)
        assert bytes(buffer.numpy()) == path.read_bytes()
        with pytest.raises(ValueError, match="aligned"):
            DirectReader(2, IO_ALIGN_BYTES).read(file, 512, IO_ALIGN_BYTES, buffer)
    finally:
        os.close(file.fd)


def test_a_filesystem_refusing_o_direct_falls_back_with_its_reason(tmp_path, monkeypatch):
    """As tmpfs before Linux 6.6 and some FUSE filesystems do: open(O_DIRECT) fails with EINVAL
    (simulated: this host's filesystems all take it). The file is read through the page cache."""
    from engine.weights import direct_io

    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & direct_io.O_DIRECT_FLAG:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    path = tmp_path / "layer.bin"
    path.write_bytes(os.urandom(2 * IO_ALIGN_BYTES))
    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    file = open_for_reading(path)
    monkeypatch.undo()
    try:
        assert not file.direct and not is_direct(file.fd)
        assert "refuses O_DIRECT" in file.reason and str(path) in file.reason
        buffer = aligned_empty(2 * IO_ALIGN_BYTES)
        DirectReader(2, IO_ALIGN_BYTES).read(file, 0, 2 * IO_ALIGN_BYTES, buffer)
        assert bytes(buffer.numpy()) == path.read_bytes()
    finally:
        os.close(file.fd)


def test_a_matching_conversion_is_reused_and_another_rewritten(tmp_path):
    loader = create_loader("smollm2-135m", "dummy")
    small = _small_loader(loader)
    linear = create_linear_method("dense")
    key = ConversionKey.create(small.source, torch.float32, "none", CPU)
    directory = direct_io_dir(tmp_path)
    assert convert(small, LayerFiles(directory, key, 2), linear, torch.float32, CPU) == (2, 0)
    assert convert(small, LayerFiles(directory, key, 2), linear, torch.float32, CPU) == (0, 2)
    other = ConversionKey.create(small.source, torch.bfloat16, "none", CPU)
    assert convert(small, LayerFiles(directory, other, 2), linear, torch.bfloat16, CPU) == (2, 0)


def _small_loader(loader):
    """The dummy loader of a preset, cut to 2 layers (files stay small)."""
    import dataclasses

    loader.config = dataclasses.replace(loader.config, num_layers=2)
    return loader


@pytest.mark.parametrize("quantization", ["none", "int4"])
@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen2-0.5b"])
def test_the_planner_counts_the_bytes_the_engine_lays_out(preset, quantization):
    config = ModelConfig.from_preset(preset)
    generator = torch.Generator().manual_seed(0)
    loaded = {key: torch.randn(shape, generator=generator) for key, shape in layer_shapes(config).items()}
    linear = create_linear_method("int4" if quantization == "int4" else "dense")
    for dtype in (torch.float32, torch.bfloat16):
        weights = LayerWeights.from_loaded(loaded, linear, dtype, CPU)
        image = LayerImage.of(weights.named_linears())
        assert image.nbytes == layer_image_bytes(config.shape, WeightFormat(quantization, dtype.itemsize))
