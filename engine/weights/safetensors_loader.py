"""Hugging Face checkpoints: a directory with config.json and one or more .safetensors files.

Every shard's header is read and checked against the config when the loader is built (names,
shapes, and that each tensor's bytes lie inside its file), so a bad checkpoint fails at start
rather than at layer 40. Tensor data is read per layer through safetensors' memory map.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.model_config import ModelConfig
from engine.weights.base import (
    MLP_KEYS,
    ROUTER_KEY,
    SHARED_EXPERT_GATE_KEY,
    WeightLoader,
    WeightLoadError,
    global_shapes,
    layer_shapes,
    register_loader,
    required_shapes,
    shape_error,
)

INDEX_FILE = "model.safetensors.index.json"
_HEADER_LENGTH_BYTES = 8  # little-endian u64 length of the JSON header that starts each file

_GLOBAL_NAMES = {
    "embed_tokens": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# A mixture-of-experts layer's tensors: the family's MoE block module and its experts' projection
# names (Mixtral: block_sparse_moe.experts.E.w1/w3/w2; the Qwen MoE families: mlp.experts.E.gate_proj/...).
_MOE_BLOCKS = {"mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}
_DEFAULT_MOE_BLOCK = ("mlp", {key: key for key in MLP_KEYS})


def layer_tensor_name(index: int, key: str, architecture: str = "llama") -> str:
    """The checkpoint name of layer `index`'s tensor `key` (engine/weights/base.py's keys)."""
    return f"model.layers.{index}.{_layer_name(key, architecture)}"


def _layer_name(key: str, architecture: str) -> str:
    if key in _LAYER_NAMES:
        return _LAYER_NAMES[key]
    block, projections = _MOE_BLOCKS.get(architecture, _DEFAULT_MOE_BLOCK)
    if key == ROUTER_KEY:
        return f"{block}.gate.weight"
    if key == SHARED_EXPERT_GATE_KEY:
        return f"{block}.shared_expert_gate.weight"
    module, projection = key.rsplit(".", 1)  # "experts.3" or "shared_expert", then "gate_proj"
    return f"{block}.{module}.{projections[projection]}.weight"


@register_loader("safetensors")
class SafetensorsLoader(WeightLoader):
    def __init__(self, model: str, seed: int = 0) -> None:
        self.directory = Path(model)
        if not self.directory.is_dir():
            raise WeightLoadError(f"{model}: not a directory (an HF safetensors checkpoint is a directory)")
        self.source = str(self.directory)
        self.tokenizer_source = str(self.directory)
        self.config = ModelConfig.from_hf_dir(self.directory)
        self._headers: dict[Path, dict[str, dict[str, Any]]] = {}  # shard -> its parsed header
        self._listing = self.directory  # the file that lists the tensor names, named in errors
        self._shard_of = self._read_weight_map()  # tensor name -> shard path
        for shard in sorted(set(self._shard_of.values()) - set(self._headers)):
            self._headers[shard] = _read_header(shard, self._shard_of)
        self._check_tensors()
        self._open_shards: dict[Path, Any] = {}

    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {key: self._load(_GLOBAL_NAMES[key], dtype) for key in global_shapes(self.config)}

    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        self._check_layer_index(index)
        return {key: self._load(self._tensor_name(index, key), dtype) for key in layer_shapes(self.config, index)}

    def _tensor_name(self, index: int, key: str) -> str:
        return layer_tensor_name(index, key, self.config.architecture)

    def _read_weight_map(self) -> dict[str, Path]:
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightLoadError(f"{index_path}: not a valid safetensors index ({e!r})") from e
            self._listing = index_path
            shard_of = {name: self.directory / file for name, file in weight_map.items()}
            for name, shard in shard_of.items():
                if not shard.is_file():
                    raise WeightLoadError(f"{shard}: shard file missing; {INDEX_FILE} puts tensor {name!r} in it")
            return shard_of
        # Unsharded checkpoints have no index: every .safetensors file is read for its names.
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            raise WeightLoadError(f"{self.directory}: no *.safetensors files")
        self._listing = shards[0] if len(shards) == 1 else self.directory
        for shard in shards:
            self._headers[shard] = _read_header(shard, {})
        return {name: shard for shard in shards for name in self._headers[shard]}

    def _check_tensors(self) -> None:
        """Every tensor the config needs is present and has the config's shape."""
        for name, shape in required_shapes(self.config, _GLOBAL_NAMES, self._tensor_name).items():
            shard = self._shard_of.get(name)
            if shard is None:
                why = " (config.json says tie_word_embeddings is false)" if name == _GLOBAL_NAMES["lm_head"] else ""
                raise WeightLoadError(f"{self._listing}: tensor {name!r} missing{why}")
            entry = self._headers[shard].get(name)
            if entry is None:
                raise WeightLoadError(f"{shard}: tensor {name!r} missing (the index lists it in this file)")
            got = tuple(entry["shape"])
            if got != shape:
                raise shape_error(shard, name, shape, got)

    def _load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        shard = self._shard_of[name]
        handle = self._open_shards.get(shard)
        try:
            if handle is None:
                handle = self._open_shards[shard] = safe_open(str(shard), framework="pt")
            return handle.get_tensor(name).to(dtype)
        except (SafetensorError, OSError) as e:
            raise WeightLoadError(f"{shard}: cannot read tensor {name!r} ({e})") from e


def _read_header(shard: Path, shard_of: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Parse a safetensors header and check every tensor's bytes lie inside the file.

    `shard_of` (from the index) lets a file too short to hold even its header name a tensor
    that should have been in it.
    """
    try:
        file_size = shard.stat().st_size
        with shard.open("rb") as f:
            prefix = f.read(_HEADER_LENGTH_BYTES)
            header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == _HEADER_LENGTH_BYTES else None
            raw = f.read(header_len) if header_len is not None and header_len <= file_size else b""
    except OSError as e:
        raise WeightLoadError(f"{shard}: cannot read ({e})") from e
    if header_len is None or len(raw) != header_len:
        expected_names = [name for name, path in shard_of.items() if path == shard]
        lost = f"; it should hold tensor {expected_names[0]!r}" if expected_names else ""
        raise WeightLoadError(f"{shard}: truncated or corrupt safetensors header{lost}")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightLoadError(f"{shard}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    data_size = file_size - _HEADER_LENGTH_BYTES - header_len
    for name, entry in header.items():
        try:
            end = int(entry["data_offsets"][1])
            entry["shape"] = [int(n) for n in entry["shape"]]
        except (KeyError, TypeError, IndexError, ValueError) as e:
            raise WeightLoadError(f"{shard}: corrupt safetensors header entry for tensor {name!r} ({e!r})") from e
        if end > data_size:
            raise WeightLoadError(
                f"{shard}: truncated; tensor {name!r} needs bytes up to {end} of the data section, "
                f"the file holds {data_size}"
            )
    return header
