"""How a model splits over tensor-parallel ranks: each rank's KV heads (with their query heads),
MLP units and LM-head rows. No torch here.

KV heads split as evenly as they go, the first ranks taking one more where they do not divide
(SmolLM2's 3 KV heads over 2 ranks: 2 and 1), so a model need not have a multiple of the rank
count; the MLP's intermediate units (every expert's, in a MoE model) split in runs of `WIDTH_UNIT`,
so a row-parallel weight's input columns cut on INT4 group boundaries. The router stays whole."""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model_config import ConfigError, ModelConfig
from scheduler.planning.cost_model import kv_bytes_per_token
from scheduler.planning.memory import WeightFormat, layer_image_bytes, resident_global_bytes

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
    expert_intermediate: tuple[int, int] | None = None  # every routed expert's units (MoE)
    shared_intermediate: tuple[int, int] | None = None  # the shared expert's units (Qwen2-MoE)

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
    experts = shared = [None] * world_size
    if config.moe is not None:
        experts = split_evenly(config.moe.expert_intermediate_size, world_size, WIDTH_UNIT)
        if config.moe.shared_expert_intermediate_size:
            shared = split_evenly(config.moe.shared_expert_intermediate_size, world_size, WIDTH_UNIT)
    return [RankShard(rank, world_size, kv_ranges[rank], group, mlp_ranges[rank], vocab_ranges[rank], rows_per_rank,
                      experts[rank], shared[rank]) for rank in range(world_size)]


def check_splittable(config: ModelConfig, world_size: int) -> None:
    """ConfigError where `config` cannot split over `world_size` ranks (one rank takes any model)."""
    if world_size == 1:
        return
    flag = f"--tensor-parallel-size {world_size}"
    if world_size > config.num_kv_heads:
        raise ConfigError(f"{flag}: the model has {config.num_kv_heads} KV heads, and each rank needs at least "
                          f"one; use at most --tensor-parallel-size {config.num_kv_heads}")
    if config.head_dim % WIDTH_UNIT:
        raise ConfigError(f"{flag}: head_dim ({config.head_dim}) must be a multiple of {WIDTH_UNIT} to split on "
                          f"INT4 group boundaries")
    for name, width in _mlp_widths(config).items():
        if width % WIDTH_UNIT or width // WIDTH_UNIT < world_size:
            raise ConfigError(f"{flag}: {name} ({width}) must be a multiple of {WIDTH_UNIT} with at least one run of "
                              f"{WIDTH_UNIT} units per rank, to split on INT4 group boundaries")


def _mlp_widths(config: ModelConfig) -> dict[str, int]:
    """The MLPs' widths that split over the ranks: the dense MLP's, a MoE model's experts' and its
    shared expert's."""
    widths = {"intermediate_size": config.intermediate_size}
    if config.moe is not None:
        widths["expert_intermediate_size"] = config.moe.expert_intermediate_size
        if config.moe.shared_expert_intermediate_size:
            widths["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    return widths


def shard_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model as rank `shard` builds it: its heads and MLP units, its LM-head rows as an untied
    head (the embeddings stay whole on every rank); the vocabulary the sampler sees is the whole one."""
    moe = config.moe
    if moe is not None:
        shared = shard.shared_intermediate
        moe = replace(moe, expert_intermediate_size=shard.expert_intermediate[1] - shard.expert_intermediate[0],
                      shared_expert_intermediate_size=shared[1] - shared[0] if shared else 0)
    return replace(config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                   intermediate_size=shard.intermediate_size, tie_word_embeddings=False, moe=moe)


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
