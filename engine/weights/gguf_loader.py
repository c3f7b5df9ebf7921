"""GGUF files (llama.cpp's format), read through the `gguf` package's memory-mapped reader.

Supported tensor types: F32, F16, BF16, Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q4_0, Q4_1, Q4_K, Q3_K,
Q2_K. A quantized tensor is dequantized with `gguf.quants` when its layer is loaded and held in
the requested dtype, except for a linear method taking packed 4-bit weights
(`--quantization int4`, `load_layer_packed`), which gets each linear weight by its type:
  - Q4_0, Q4_1, Q4_K: repacked exactly into int4's layout (gguf_int4.py, one repacker per type);
  - Q8_0, Q6_K, Q5_*, Q3_K, Q2_K: dequantized and marked `KeepDense`, so that the method keeps
    them dense rather than quantize already quantized values a second time;
  - F32, F16, BF16: plain tensors, which the method quantizes by round-to-nearest.
The embeddings and LM head are always dequantized and stay dense. When layer 0 is loaded the log
says what each weight matrix became, counted from the tensors' types. Tensor names, types,
shapes and byte ranges are all checked when the loader is built.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.model_config import ConfigError, ModelConfig
from engine.quant.int4 import KeepDense, PackedInt4
from engine.weights.base import (
    WeightLoader,
    WeightLoadError,
    global_shapes,
    layer_shapes,
    register_loader,
    shape_error,
)
from engine.weights.gguf_int4 import REPACKERS

logger = logging.getLogger(__name__)

# Unquantized types: a quantizing linear method quantizes these like any dense checkpoint's.
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# Quantized types int4's layout does not hold exactly: more bits, or 16-weight sub-blocks.
_DEQUANTIZED_TYPES = frozenset({
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q2_K,
})
SUPPORTED_TYPES = _FLOAT_TYPES | _DEQUANTIZED_TYPES | frozenset(REPACKERS)

_GLOBAL_NAMES = {
    "embed_tokens": "token_embd.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_attention_layernorm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "router": "ffn_gate_inp.weight",
    "shared_expert.gate_proj": "ffn_gate_shexp.weight",
    "shared_expert.up_proj": "ffn_up_shexp.weight",
    "shared_expert.down_proj": "ffn_down_shexp.weight",
    "shared_expert_gate": "ffn_gate_inp_shexp.weight",
}
# llama.cpp keeps each projection of all a layer's experts in one 3-D tensor, [experts, out, in]
# in Hugging Face's order of dimensions; expert e's matrix is its slice e.
_EXPERT_STACKS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                  "down_proj": "ffn_down_exps.weight"}
# Tensors llama.cpp stores with fewer dimensions than Hugging Face: the shared expert's gate is
# [hidden] there, [1, hidden] here.
_FLATTENED_KEYS = frozenset({"shared_expert_gate"})
# llama.cpp's converter reorders the Q/K rows of these architectures for its interleaved
# RoPE; Qwen files keep Hugging Face's order.
_PERMUTED_ARCHITECTURES = frozenset({"llama", "mistral", "mixtral"})


def layer_tensor_name(index: int, key: str) -> str:
    return f"blk.{index}.{_LAYER_NAMES[key]}"


def _is_linear(key: str) -> bool:
    return key.endswith("_proj")


def _expert_key(key: str) -> tuple[int, str] | None:
    """(expert, projection) of a routed expert's key ("experts.3.up_proj"), else None."""
    if not key.startswith("experts."):
        return None
    _, expert, projection = key.split(".")
    return int(expert), projection


def _layer_tensor_shapes(config: ModelConfig, index: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Layer `index`'s GGUF tensors: name -> (shape in Hugging Face's order, the layer keys it holds).
    A routed expert's matrices live in their projection's 3-D stack; the rest one key each."""
    tensors = {}
    stacked: dict[str, list[str]] = {}
    shapes = layer_shapes(config, index)
    for key, shape in shapes.items():
        expert = _expert_key(key)
        if expert is None:
            shape = (shape[-1],) if key in _FLATTENED_KEYS else shape
            tensors[layer_tensor_name(index, key)] = (shape, (key,))
        else:
            stacked.setdefault(expert[1], []).append(key)
    for projection, keys in stacked.items():
        tensors[f"blk.{index}.{_EXPERT_STACKS[projection]}"] = ((len(keys), *shapes[keys[0]]), tuple(keys))
    return tensors


def _split_experts(stacked: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """A 3-D stack (tensor, PackedInt4 or KeepDense over [experts * rows, ...]) -> each key's slice."""
    if isinstance(stacked, KeepDense):
        return {key: KeepDense(part) for key, part in _split_experts(stacked.weight, keys).items()}
    if isinstance(stacked, PackedInt4):
        rows = stacked.shape[0] // len(keys)
        return {key: stacked.take_rows(torch.arange(e * rows, (e + 1) * rows)) for e, key in enumerate(keys)}
    return dict(zip(keys, stacked.unbind(0)))


class _Int4Handling(Enum):
    """How a linear weight goes to the int4 method (load_layer_packed), by its type; the values
    are the load log's words."""

    PACKED = "int4, packed as stored"  # REPACKERS: the blocks repacked exactly
    QUANTIZED = "then int4 by round-to-nearest"  # _FLOAT_TYPES: the method quantizes it at load
    # _DEQUANTIZED_TYPES: quantizing it again would blur it; dequantized once and kept dense
    KEPT_DENSE = "kept dense"


def _int4_handling(qtype: GGMLQuantizationType) -> _Int4Handling:
    if qtype in REPACKERS:
        return _Int4Handling.PACKED
    return _Int4Handling.QUANTIZED if qtype in _FLOAT_TYPES else _Int4Handling.KEPT_DENSE


def _read_as(qtype: GGMLQuantizationType, dtype: torch.dtype) -> str:
    verb = "read as" if qtype in _FLOAT_TYPES else "dequantized to"
    return f"{verb} {str(dtype).removeprefix('torch.')}"


def _int4_becomes(qtype: GGMLQuantizationType, dtype: torch.dtype) -> str:
    handling = _int4_handling(qtype)
    return handling.value if handling is _Int4Handling.PACKED else f"{_read_as(qtype, dtype)}, {handling.value}"


@register_loader("gguf")
class GGUFLoader(WeightLoader):
    def __init__(self, model: str, seed: int = 0) -> None:
        self.path = Path(model)
        if not self.path.is_file():
            raise WeightLoadError(f"{model}: GGUF file not found")
        self.source = str(self.path)
        self.tokenizer_source = str(self.path)
        self._reader, metadata = _parsed(self.path)
        self.metadata = dict(metadata)
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        try:
            config = ModelConfig.from_gguf_metadata(self.metadata)
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise WeightLoadError(f"{self.path}: cannot build the model config from GGUF metadata ({e})") from e
        if _GLOBAL_NAMES["lm_head"] in self._tensors:
            config = dataclasses.replace(config, tie_word_embeddings=False)
        self.config = config
        self._check_tensors()

    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {key: self._load(_GLOBAL_NAMES[key], dtype) for key in global_shapes(self.config)}

    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self._load_layer(index, dtype, for_int4=False)

    def load_layer_packed(self, index: int, dtype: torch.dtype) -> dict[str, Any]:
        return self._load_layer(index, dtype, for_int4=True)

    def _load_layer(self, index: int, dtype: torch.dtype, for_int4: bool) -> dict[str, Any]:
        self._check_layer_index(index)
        if index == 0:
            logger.info("%s: %s", self.path.name, self._load_summary(dtype, for_int4))
        weights = {}
        for name, (_, keys) in _layer_tensor_shapes(self.config, index).items():
            value = self._load_for_int4(name, dtype) if for_int4 and _is_linear(keys[0]) else self._load(name, dtype)
            if _expert_key(keys[0]) is not None:
                weights.update(_split_experts(value, keys))
            else:
                weights[keys[0]] = value[None] if keys[0] in _FLATTENED_KEYS else value
        if self.config.architecture in _PERMUTED_ARCHITECTURES:
            for key, num_heads in (("q", self.config.num_heads), ("k", self.config.num_kv_heads)):
                weights[f"{key}_proj"] = _unpermute_rows(weights[f"{key}_proj"], num_heads)
                if f"{key}_bias" in weights:
                    weights[f"{key}_bias"] = _unpermute_rows(weights[f"{key}_bias"], num_heads)
        return weights

    def stores_int4(self) -> bool:
        handlings = {_int4_handling(self._tensors[name].tensor_type) for name in self._linear_tensor_names()}
        return _Int4Handling.PACKED in handlings and _Int4Handling.QUANTIZED not in handlings

    def _linear_tensor_names(self) -> list[str]:
        return [name for index in range(self.config.num_layers)
                for name, (_, keys) in _layer_tensor_shapes(self.config, index).items() if _is_linear(keys[0])]

    def _load_for_int4(self, name: str, dtype: torch.dtype) -> torch.Tensor | PackedInt4 | KeepDense:
        """A linear weight as the int4 method takes it (see _int4_handling)."""
        handling = _int4_handling(self._tensors[name].tensor_type)
        if handling is _Int4Handling.PACKED:
            return self._load_packed(name)
        weight = self._load(name, dtype)
        return KeepDense(weight) if handling is _Int4Handling.KEPT_DENSE else weight

    def _load_packed(self, name: str) -> PackedInt4:
        """The tensor's blocks, uint8 [rows, blocks per row, bytes per block], repacked exactly."""
        tensor = self._tensors[name]
        rows = int(np.prod(_hf_shape(tensor)[:-1]))  # an expert stack's experts' rows one after another
        _, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = torch.from_numpy(np.array(tensor.data, copy=True)).view(rows, -1, type_size)
        return REPACKERS[tensor.tensor_type](blocks)

    def _load_summary(self, dtype: torch.dtype, for_int4: bool) -> str:
        """What each weight matrix becomes, derived from the tensors' types, e.g. "the embeddings
        (token_embd.weight, Q4_K) -> dequantized to bfloat16, kept dense; 168 Q4_K linear weights
        -> int4, packed as stored; 42 Q6_K linear weights -> dequantized to bfloat16, kept dense"."""
        globals_ = global_shapes(self.config)
        roles = {"embed_tokens": "the embeddings" if "lm_head" in globals_ else "the embeddings and LM head",
                 "lm_head": "the LM head"}
        items = []
        for key, role in roles.items():
            if key in globals_:
                qtype = self._tensors[_GLOBAL_NAMES[key]].tensor_type
                # the model keeps the embeddings and LM head dense whatever the linear method
                items.append(f"{role} ({_GLOBAL_NAMES[key]}, {qtype.name}) -> "
                             f"{_read_as(qtype, dtype)}{', kept dense' if for_int4 else ''}")
        counts = Counter(self._tensors[name].tensor_type for name in self._linear_tensor_names())
        for qtype, count in sorted(counts.items(), key=lambda item: (-item[1], item[0].name)):
            becomes = _int4_becomes(qtype, dtype) if for_int4 else _read_as(qtype, dtype)
            items.append(f"{count} {qtype.name} linear weight{'s' if count != 1 else ''} -> {becomes}")
        return "; ".join(items)

    def _check_tensors(self) -> None:
        """Every tensor the config needs is present, of a supported type, and the config's shape."""
        required = {_GLOBAL_NAMES[key]: shape for key, shape in global_shapes(self.config).items()}
        for index in range(self.config.num_layers):
            required.update({name: shape for name, (shape, _) in _layer_tensor_shapes(self.config, index).items()})
        for name, shape in required.items():
            tensor = self._tensors.get(name)
            if tensor is None:
                raise WeightLoadError(f"{self.path}: tensor {name!r} missing")
            if tensor.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
                raise WeightLoadError(
                    f"{self.path}: tensor {name!r} has type {tensor.tensor_type.name}; supported: {supported}"
                )
            got = _hf_shape(tensor)
            if got != shape:
                raise shape_error(self.path, name, shape, got)

    def _load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._tensors[name]
        try:
            values = dequantize(tensor.data, tensor.tensor_type).reshape(_hf_shape(tensor))  # float32
        except (ValueError, NotImplementedError, OSError) as e:
            raise WeightLoadError(f"{self.path}: cannot read tensor {name!r} ({e})") from e
        if not values.flags.writeable:  # a view of the read-only memory map (F32 tensors)
            values = values.copy()
        return torch.from_numpy(values).to(dtype)


class GgufReader(GGUFReader):
    """A GGUFReader that parses the metadata 4x faster and names the tensor when the file ends
    before that tensor's data.

    The stock reader builds a numpy view of every tensor while parsing and, on a short file,
    fails with a reshape error naming nothing. This override checks the byte ranges first; it
    relies on the reader's tensor-info field layout (name length, name, n_dims, dims, type,
    offset), stable since gguf 0.6.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(path)

    def _build_fields(self, offs: int, count: int) -> int:
        # Parsed over a plain ndarray view of the same map: the stock reader slices the np.memmap once
        # per array element, and its per-slice bookkeeping made the embedded model's 49k-token
        # vocabulary 3 of an engine's 6 s to start (0.7 s this way).
        memmap, self.data = self.data, self.data.view(np.ndarray)
        try:
            return super()._build_fields(offs, count)
        finally:
            self.data = memmap

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        file_size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            sizes = GGML_QUANT_SIZES.get(_quant_type(int(raw_type[0])))
            if sizes is None:  # unknown type: the stock reader reports it
                continue
            block_size, type_size = sizes
            num_bytes = int(np.prod(dims, dtype=np.uint64)) * type_size // block_size
            end = start_offs + int(offset[0]) + num_bytes
            if end > file_size:
                name = bytes(name_data).decode("utf-8", errors="replace")
                raise WeightLoadError(
                    f"{self.path}: truncated; tensor {name!r} needs bytes up to {end}, the file has {file_size}"
                )
        super()._build_tensors(start_offs, fields)


def _quant_type(raw: int) -> GGMLQuantizationType | None:
    try:
        return GGMLQuantizationType(raw)
    except ValueError:
        return None


def _parsed(path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The file's reader and decoded metadata, parsed once per process while the file is unchanged:
    a process that builds several engines on one model (tests, a restart after a bad flag) pays the
    parse once."""
    stat = path.stat()
    return _parsed_file(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _parsed_file(path: Path, mtime_ns: int, size_bytes: int) -> tuple[GGUFReader, dict[str, Any]]:
    reader = _open_reader(path)
    return reader, _decode_metadata(reader, path)


def _open_reader(path: Path) -> GGUFReader:
    try:
        return GgufReader(path)
    except WeightLoadError:
        raise
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise WeightLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from e


def _decode_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, UnicodeDecodeError, IndexError) as e:
        raise WeightLoadError(f"{path}: corrupt GGUF metadata ({e})") from e


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    # GGUF lists dimensions innermost first: [in_features, out_features] for a linear.
    return tuple(int(n) for n in reversed(tensor.shape))


def _unpermute_rows(weight: torch.Tensor | PackedInt4 | KeepDense, num_heads: int) -> Any:
    """Undo llama.cpp's Q/K row order: within each head it interleaves the two rotary halves
    as [head_dim/2, 2]; Hugging Face's rotate-half keeps them as [2, head_dim/2]."""
    if isinstance(weight, PackedInt4):  # the same order of whole rows
        return weight.take_rows(_unpermute_rows(torch.arange(weight.shape[0]), num_heads))
    if isinstance(weight, KeepDense):
        return KeepDense(_unpermute_rows(weight.weight, num_heads))
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)
