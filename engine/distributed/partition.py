"""How a model splits over tensor-parallel ranks: each rank's KV heads (with their query heads),
MLP units and LM-head rows. No torch here.

KV heads split as evenly as they go, the first ranks taking one more where they do not divide
(SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so a model need not have a multiple of the rank
count; the MLP's intermediate units split in runs of `WIDTH_UNIT`, so a row-parallel weight's
input columns cut on INT4 group boundaries."""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model.config import ConfigError, ModelConfig

# Columns a row-parallel weight's input is cut in: the INT4 group (32 weights, GGUF's Q4 block).
WIDTH_UNIT = 32


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of `world_size`: the half-open ranges of the model it holds."""

    rank: int
    world_size: int
    kv_heads: tuple[int, int]
    queries_per_kv_head: int
    intermediate: tuple[int, int]  # the MLP's units (gate/up rows, down columns)
    vocab: tuple[int, int]  # LM-head rows
    vocab_rows_per_rank: int  # every rank's LM-head shard is padded to this many rows for the gather

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def q_heads(self) -> tuple[int, int]:
        return self.kv_heads[0] * self.queries_per_kv_head, self.kv_heads[1] * self.queries_per_kv_head

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.queries_per_kv_head

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]


def split_evenly(total: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, total) cut into `parts` ranges of whole `unit`s as even as they go, the first ones
    one unit longer where they do not divide (total a multiple of unit)."""
    num_units = total // unit
    base, extra = divmod(num_units, parts)
    ranges, start = [], 0
    for part in range(parts):
        end = start + (base + (part < extra)) * unit
        ranges.append((start, end))
        start = end
    return ranges


def plan_shards(config: ModelConfig, world_size: int) -> list[RankShard]:
    """Every rank's shard of `config`; ConfigError naming what to change where it does not split."""
    check_splittable(config, world_size)
    kv_ranges = split_evenly(config.num_kv_heads, world_size)
    mlp_ranges = split_evenly(config.intermediate_size, world_size, WIDTH_UNIT)
    vocab_ranges = split_evenly(config.vocab_size, world_size)
    rows_per_rank = max(end - start for start, end in vocab_ranges)
    group = config.num_heads // config.num_kv_heads
    return [RankShard(rank, world_size, kv_ranges[rank], group, mlp_ranges[rank], vocab_ranges[rank], rows_per_rank)
            for rank in range(world_size)]


def check_splittable(config: ModelConfig, world_size: int) -> None:
    """ConfigError where `config` cannot split over `world_size` ranks."""
    flag = f"--tensor-parallel-size {world_size}"
    if config.is_moe:
        raise ConfigError(f"{flag}: {config.architecture} routes experts, and splitting experts over ranks is "
                          "not built; serve a MoE model with --tensor-parallel-size 1")
    if world_size > config.num_kv_heads:
        raise ConfigError(f"{flag}: the model has {config.num_kv_heads} KV heads, and each rank needs at least "
                          f"one; use at most --tensor-parallel-size {config.num_kv_heads}")
    if config.head_dim % WIDTH_UNIT or config.intermediate_size % WIDTH_UNIT:
        raise ConfigError(f"{flag}: head_dim ({config.head_dim}) and intermediate_size ({config.intermediate_size}) "
                          f"must be multiples of {WIDTH_UNIT} to split on INT4 group boundaries")
    if config.intermediate_size // WIDTH_UNIT < world_size:
        raise ConfigError(f"{flag}: intermediate_size {config.intermediate_size} has fewer than {world_size} "
                          f"runs of {WIDTH_UNIT} units")


def shard_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model as rank `shard` builds it: its heads and MLP units, its LM-head rows as an untied
    head (the embeddings stay whole on every rank); the vocabulary the sampler sees is the whole one."""
    return replace(config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                   intermediate_size=shard.intermediate_size, tie_word_embeddings=False)


def largest_rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The model as its largest rank holds it (rank 0: the first ranks take the remainders), which
    sizes every rank's KV pools; `config` itself with one rank."""
    return config if world_size == 1 else shard_config(config, plan_shards(config, world_size)[0])
