"""A loader handing out one tensor-parallel rank's share of another loader's weights.

Column-parallel weights (Q, K, V with their biases, gate and up: the dense MLP's and every
expert's) keep the rank's output rows; row-parallel ones (O and down) the matching input columns;
norms, the router and the shared expert's gate stay whole. Packed INT4 weights
split the same way, by rows or by whole groups of columns, so no weight is quantized again."""
from __future__ import annotations

from typing import Any

import torch

from engine.distributed.partition import RankShard, shard_config
from engine.model_config import ConfigError
from engine.quant.int4 import weight_columns, weight_rows
from engine.weights.base import SHARED_EXPERT_PREFIX, WeightLoader


class ShardedLoader(WeightLoader):
    def __init__(self, inner: WeightLoader, shard: RankShard) -> None:
        self.inner, self.shard = inner, shard
        self.full_config = inner.config
        self.config = shard_config(inner.config, shard)
        self.source, self.tokenizer_source = inner.source, inner.tokenizer_source

    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The embeddings whole; this rank's LM-head rows, padded with zero rows to the size every
        rank's shard has (the gather's), as an untied head."""
        loaded = self.inner.load_globals(dtype)
        head = loaded["embed_tokens"] if self.full_config.tie_word_embeddings else loaded["lm_head"]
        start, end = self.shard.vocab
        rows = head.new_zeros(self.shard.vocab_rows_per_rank, head.shape[1])
        rows[:end - start] = head[start:end]
        return {"embed_tokens": loaded["embed_tokens"], "norm": loaded["norm"], "lm_head": rows}

    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self._shard_layer(self.inner.load_layer(index, dtype))

    def load_layer_packed(self, index: int, dtype: torch.dtype) -> dict[str, Any]:
        return self._shard_layer(self.inner.load_layer_packed(index, dtype))

    def stores_int4(self) -> bool:
        return self.inner.stores_int4()

    def _shard_layer(self, loaded: dict[str, Any]) -> dict[str, Any]:
        head_dim = self.config.head_dim
        q_rows = tuple(head_dim * h for h in self.shard.q_heads)
        kv_rows = tuple(head_dim * h for h in self.shard.kv_heads)
        rows = {"q_proj": q_rows, "q_bias": q_rows, "k_proj": kv_rows, "k_bias": kv_rows, "v_proj": kv_rows,
                "v_bias": kv_rows}
        sharded = {}
        for key, tensor in loaded.items():
            prefix, _, name = key.rpartition(".")
            if key in rows:
                tensor = weight_rows(tensor, *rows[key])
            elif key == "o_proj":
                tensor = _columns(tensor, *q_rows, key)
            elif name in ("gate_proj", "up_proj"):
                tensor = weight_rows(tensor, *self._units(prefix))
            elif name == "down_proj":
                tensor = _columns(tensor, *self._units(prefix), key)
            sharded[key] = tensor
        return sharded

    def _units(self, prefix: str) -> tuple[int, int]:
        """This rank's units of the MLP under `prefix`: a routed expert's ("experts.3"), the shared
        expert's ("shared_expert") or the dense MLP's ("")."""
        if prefix.startswith("experts."):
            return self.shard.expert_intermediate
        if prefix == SHARED_EXPERT_PREFIX.rstrip("."):
            return self.shard.shared_intermediate
        return self.shard.intermediate


def _columns(weight: Any, start: int, end: int, key: str) -> Any:
    try:
        return weight_columns(weight, start, end)
    except ValueError as exc:
        raise ConfigError(f"{key}: this rank's columns [{start}, {end}) do not fall on the checkpoint's INT4 "
                          f"groups; use another --tensor-parallel-size") from exc
