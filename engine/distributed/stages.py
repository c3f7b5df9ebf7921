"""Pipeline parallelism (--pipeline-parallel-size): the decoder layers cut into contiguous stages,
each a Ray actor with its own layers, its own KV pools for them and its own cores. A step's
hidden states go from stage to stage: the first embeds the tokens, the last applies the final
norm and LM head and samples. Only one activation a step crosses between stages, where tensor
parallelism all-reduces twice a layer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.layer_store import DelegatingLayerStore, LayerStore
from engine.model_config import ConfigError, ModelConfig
from engine.weights.base import WeightLoader
from scheduler.planning.cost_model import kv_bytes_per_token
from scheduler.planning.memory import WeightFormat, layer_image_bytes, resident_global_bytes


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `num_stages`: the decoder layers [layers[0], layers[1])."""

    index: int
    num_stages: int
    layers: tuple[int, int]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


def plan_stages(config: ModelConfig, num_stages: int) -> list[Stage]:
    """Contiguous layer ranges as even as they go (the first stages take one more); ConfigError
    where a stage would hold no layer or a layer's index decides its kind (MoE)."""
    if num_stages > config.num_layers:
        raise ConfigError(f"--pipeline-parallel-size {num_stages}: the model has {config.num_layers} decoder "
                          f"layers, fewer than the stages; use at most {config.num_layers}")
    if config.is_moe:
        raise ConfigError(f"--pipeline-parallel-size {num_stages}: {config.architecture}'s layers are not cut into "
                          f"stages yet (a MoE layer's kind follows its index); use --tensor-parallel-size")
    base, extra = divmod(config.num_layers, num_stages)
    stages, start = [], 0
    for index in range(num_stages):
        end = start + base + (1 if index < extra else 0)
        stages.append(Stage(index, num_stages, (start, end)))
        start = end
    return stages


class StageLoader(WeightLoader):
    """Another loader's model as a stage holds it: its layers renumbered from 0, the globals whole
    (the first stage embeds, the last norms and applies the head)."""

    def __init__(self, inner: WeightLoader, stage: Stage) -> None:
        self.inner, self.stage = inner, stage
        self.config = dataclasses.replace(inner.config, num_layers=stage.num_layers)
        self.source, self.tokenizer_source = inner.source, inner.tokenizer_source

    def load_globals(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self.inner.load_globals(dtype)

    def load_layer(self, index: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self.inner.load_layer(self.stage.layers[0] + index, dtype)

    def load_layer_packed(self, index: int, dtype: torch.dtype) -> dict[str, Any]:
        return self.inner.load_layer_packed(self.stage.layers[0] + index, dtype)

    def stores_int4(self) -> bool:
        return self.inner.stores_int4()


class StageLayers(DelegatingLayerStore):
    """Another store's layers as one stage of the pipeline: a later stage's first layer reads
    `incoming` (the previous stage's output, set before each forward); an earlier stage's last
    layer leaves its output in `outgoing` and no logits."""

    def __init__(self, inner: LayerStore, stage: Stage) -> None:
        super().__init__(inner)
        self.stage = stage
        self.incoming: torch.Tensor | None = None
        self.outgoing: torch.Tensor | None = None

    @property
    def graph_capturable(self) -> bool:
        return self.stage.num_stages == 1 and self.inner.graph_capturable  # a graph would keep one step's input

    def stage_input(self, token_ids: torch.Tensor, embed) -> torch.Tensor:
        if self.stage.first:
            return self.inner.stage_input(token_ids, embed)
        hidden, self.incoming = self.incoming, None
        if hidden is None or hidden.shape[0] != token_ids.shape[0]:
            raise RuntimeError(f"pipeline stage {self.stage.index}: the previous stage's output has "
                               f"{None if hidden is None else hidden.shape[0]} rows for {token_ids.shape[0]} tokens")
        return hidden.to(self.device)

    def stage_output(self, hidden: torch.Tensor, output_rows: torch.Tensor, head) -> torch.Tensor:
        if self.stage.last:
            return self.inner.stage_output(hidden, output_rows, head)
        self.outgoing = hidden
        return hidden.new_empty((output_rows.shape[0], 0))


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds: its layers' weights, the globals (every stage loads them whole, for
    now), and the bytes a token's KV takes in its pools (its layers' K and V)."""

    stage: Stage
    layer_bytes: int
    global_bytes: int
    kv_bytes_per_token: int

    def to_dict(self) -> dict:
        return {"stage": self.stage.index, "layers": list(self.stage.layers),
                "weight_bytes": self.layer_bytes + self.global_bytes, "kv_bytes_per_token": self.kv_bytes_per_token}

    def describe(self) -> str:
        gib, (start, end) = 2**30, self.stage.layers
        return (f"stage {self.stage.index}: layers {start}-{end - 1}; weights {(self.layer_bytes + self.global_bytes) / gib:.2f} "
                f"GiB (layers {self.layer_bytes / gib:.2f}, embeddings and head {self.global_bytes / gib:.2f}), KV "
                f"{self.kv_bytes_per_token} bytes a token")


def stage_memories(config: ModelConfig, num_stages: int, fmt: WeightFormat,
                   kv_element_bytes: float) -> list[StageMemory]:
    """Each stage's weights and KV bytes a token under weight format `fmt` (`tandem plan`)."""
    layer_bytes = layer_image_bytes(config.shape, fmt)
    global_bytes = resident_global_bytes(config.shape, fmt.dtype_bytes)
    return [StageMemory(stage, stage.num_layers * layer_bytes, global_bytes,
                        kv_bytes_per_token(stage.num_layers, config.num_kv_heads, config.head_dim, kv_element_bytes))
            for stage in plan_stages(config, num_stages)]


def describe_stages(memories: list[StageMemory], ranks_per_stage: int = 1) -> str:
    actors = (f"{len(memories)} stages (Ray actors)" if ranks_per_stage == 1 else
              f"{len(memories)} stages of {ranks_per_stage} tensor-parallel ranks ({len(memories) * ranks_per_stage} "
              f"Ray actors; a rank holds its share, as above, of its stage's layers)")
    lines = [f"pipeline parallel: {actors}, each with its own layers and KV pools; "
             f"a step's hidden states pass from stage to stage"]
    return "\n".join(lines + [f"  {memory.describe()}" for memory in memories])
