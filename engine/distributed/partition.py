"""How a model splits over tensor-parallel ranks: each rank's KV heads (with their query heads),
MLP units and LM-head rows. No torch here.

KV heads split as evenly as they go, the first ranks taking one more where they do not divide
(SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so a model need not have a multiple of the rank
count; the MLP's intermediate units split in runs of `WIDTH_UNIT`, so a row-parallel weight's
input columns cut on INT4 group boundaries."""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model.config import ConfigError, ModelConfig
from scheduler.cost_model import kv_bytes_per_token
from scheduler.placement.memory import WeightFormat, layer_image_bytes, resident_global_bytes

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


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds: its shard's weights on its GPU and the bytes a token's KV takes in its
    pools (its KV heads of every layer)."""

    shard: RankShard
    layer_bytes: int  # every decoder layer's linear weights and norms
    global_bytes: int  # the embeddings (whole), the final norm, its LM-head rows
    kv_bytes_per_token: int

    @property
    def weight_bytes(self) -> int:
        return self.layer_bytes + self.global_bytes

    def to_dict(self) -> dict:
        shard = self.shard
        return {"rank": shard.rank, "kv_heads": list(shard.kv_heads), "q_heads": list(shard.q_heads),
                "mlp_units": list(shard.intermediate), "lm_head_rows": list(shard.vocab),
                "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token}

    def describe(self) -> str:
        shard, gib = self.shard, 2**30
        return (f"rank {shard.rank}: KV heads {_span(shard.kv_heads)} (query heads {_span(shard.q_heads)}), "
                f"MLP units {_span(shard.intermediate)}, LM-head rows {_span(shard.vocab)}; weights "
                f"{self.weight_bytes / gib:.2f} GiB (layers {self.layer_bytes / gib:.2f}, embeddings and head "
                f"{self.global_bytes / gib:.2f}), KV {self.kv_bytes_per_token} bytes a token")


def rank_memories(config: ModelConfig, world_size: int, fmt: WeightFormat, kv_element_bytes: float) -> list[RankMemory]:
    """Each rank's weights and KV bytes a token under weight format `fmt` (`tandem plan`'s per-rank
    accounting)."""
    memories = []
    for shard in plan_shards(config, world_size):
        layer_bytes = config.num_layers * layer_image_bytes(shard_config(config, shard).shape, fmt)
        kv = kv_bytes_per_token(config.num_layers, shard.num_kv_heads, config.head_dim, kv_element_bytes)
        memories.append(RankMemory(shard, layer_bytes, _global_bytes(config, shard, fmt.dtype_bytes), kv))
    return memories


def _global_bytes(config: ModelConfig, shard: RankShard, dtype_bytes: int) -> int:
    """The embeddings whole and the rank's padded LM-head rows (one rank: the head as the model
    ties it or not), the final norm and every layer's two norms."""
    if shard.world_size == 1:
        return resident_global_bytes(config.shape, dtype_bytes)
    norms = (1 + 2 * config.num_layers) * config.hidden_size
    return ((config.vocab_size + shard.vocab_rows_per_rank) * config.hidden_size + norms) * dtype_bytes


def describe_ranks(memories: list[RankMemory]) -> str:
    lines = [f"tensor parallel: {len(memories)} ranks (Ray actors), each with its own GPU and host KV pools; one "
             f"all-reduce after each layer's attention and one after its MLP, the LM head's logits gathered"]
    return "\n".join(lines + [f"  {memory.describe()}" for memory in memories])


def _span(half_open: tuple[int, int]) -> str:
    return f"{half_open[0]}-{half_open[1] - 1}"
