"""How a model splits over tensor-parallel ranks, and each rank's share of the weights: the shards
put back together are the model's weights, dense and packed INT4 alike."""
import dataclasses

import pytest
import torch

from engine.distributed.partition import (WIDTH_UNIT, describe_ranks, largest_rank_config, plan_shards, rank_memories,
                                          split_evenly)
from engine.distributed.sharded_loader import ShardedLoader
from engine.distributed.wire import wire_plan
from engine.model_config import ConfigError
from engine.model_config import ModelConfig
from engine.weights import EMBEDDED_MODEL, create_loader
from scheduler.planning.memory import WeightFormat
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence


def test_split_evenly_gives_the_first_parts_the_remainder():
    assert split_evenly(3, 2) == [(0, 2), (2, 3)]
    assert split_evenly(1536, 2, 32) == [(0, 768), (768, 1536)]
    assert split_evenly(160, 3, 32) == [(0, 64), (64, 128), (128, 160)]


@pytest.fixture(scope="module")
def embedded():
    return create_loader(EMBEDDED_MODEL)


def test_smollm2s_three_kv_heads_split_two_and_one(embedded):
    config = embedded.config
    shards = plan_shards(config, 2)
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 3)]
    assert [s.q_heads for s in shards] == [(0, 6), (6, 9)]
    assert [s.vocab for s in shards] == [(0, config.vocab_size // 2), (config.vocab_size // 2, config.vocab_size)]
    assert largest_rank_config(config, 2).num_kv_heads == 2 and largest_rank_config(config, 1) is config


@pytest.mark.parametrize("world_size, message", [(4, "at most --tensor-parallel-size 3"), (3, None)])
def test_more_ranks_than_kv_heads_is_refused(embedded, world_size, message):
    if message is None:
        assert len(plan_shards(embedded.config, world_size)) == world_size
        return
    with pytest.raises(ConfigError, match=message):
        plan_shards(embedded.config, world_size)


def test_every_expert_splits_by_its_units_and_the_router_stays_whole():
    loader = create_loader("qwen3-moe-tiny", "dummy")
    shards = plan_shards(loader.config, 2)
    assert [s.expert_intermediate for s in shards] == [(0, 32), (32, 64)]
    whole = loader.load_layer(0, torch.float32)
    ranks = [ShardedLoader(loader, shard).load_layer(0, torch.float32) for shard in shards]
    for key, dim in (("experts.5.gate_proj", 0), ("experts.5.up_proj", 0), ("experts.5.down_proj", 1)):
        assert torch.equal(_joined([rank[key] for rank in ranks], dim), whole[key]), key
    assert all(torch.equal(rank["router"], whole["router"]) for rank in ranks)
    assert ShardedLoader(loader, shards[1]).config.moe.expert_intermediate_size == 32
    with pytest.raises(ConfigError, match="expert_intermediate_size \\(64\\) must be a multiple of 32 with at least"):
        plan_shards(dataclasses.replace(loader.config, num_kv_heads=4), 3)


def _joined(parts, dim):
    return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "int4"])
def test_shards_put_back_together_are_the_layer(embedded, packed):
    """Column-parallel rows and row-parallel columns of every rank, concatenated in rank order, are
    the whole layer's weights; packed INT4 codes, scales and mins alike; norms whole on each rank."""
    load = "load_layer_packed" if packed else "load_layer"
    whole = getattr(embedded, load)(0, torch.float32)
    ranks = [getattr(ShardedLoader(embedded, shard), load)(0, torch.float32)
             for shard in plan_shards(embedded.config, 3)]
    fields = ("qweight", "scales", "mins") if packed else (None,)
    for key, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("gate_proj", 0), ("up_proj", 0),
                     ("o_proj", 1), ("down_proj", 1)):
        for name in fields:
            parts = [getattr(rank[key], name) if name else rank[key] for rank in ranks]
            expected = getattr(whole[key], name) if name else whole[key]
            assert torch.equal(_joined(parts, dim), expected), (key, name)
    for rank in ranks:
        assert torch.equal(rank["input_layernorm"], whole["input_layernorm"])


def test_lm_head_rows_padded_alike_and_embeddings_whole(embedded):
    globals_ = embedded.load_globals(torch.float32)
    shards = plan_shards(embedded.config, 3)
    heads = [ShardedLoader(embedded, shard).load_globals(torch.float32) for shard in shards]
    assert len({h["lm_head"].shape for h in heads}) == 1
    rows = torch.cat([h["lm_head"][:end - start] for h, (start, end) in zip(heads, (s.vocab for s in shards))])
    assert torch.equal(rows, globals_["embed_tokens"])  # SmolLM2 ties its head to the embeddings
    assert all(torch.equal(h["embed_tokens"], globals_["embed_tokens"]) for h in heads)
    assert not ShardedLoader(embedded, shards[0]).config.tie_word_embeddings


def test_columns_off_the_int4_groups_are_refused():
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=3 * WIDTH_UNIT,
                         num_layers=1, num_heads=2, num_kv_heads=2, head_dim=48, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                         attention_bias=False)
    with pytest.raises(ConfigError, match="head_dim \\(48\\) must be a multiple of 32"):
        plan_shards(config, 2)


class _Grammar:
    def fill_mask(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 0b100

    def accept(self, token_id):
        return True

    def is_terminated(self):
        return False


def test_a_wire_plan_carries_the_forward_and_the_grammars_mask():
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64))
    seq = Sequence("a", list(range(9)), SamplingParams(max_tokens=4, presence_penalty=0.5))
    seq.grammar = _Grammar()
    scheduler.add_sequence(seq)
    plan = scheduler.schedule()
    wired = wire_plan(plan, vocab_size=70)
    (share,) = wired.prefills
    assert (share.token_ids, share.num_new_tokens, share.sequence.block_ids) == (list(range(9)), 9, seq.block_ids)
    assert share.sequence.sampling_params == seq.sampling_params and share.sequence.text is None
    bitmask = torch.full((1, 3), -1, dtype=torch.int32)
    share.sequence.grammar.fill_mask(bitmask, 0)
    assert bitmask.tolist() == [[0b100, 0, 0]]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_ranks_hold_the_layers_between_them_and_the_embeddings_each(quantization):
    """Dense layers split with nothing lost or doubled; each rank holds the embeddings whole and
    its padded LM-head rows; KV bytes a token follow the KV heads."""
    config = create_loader("llama-3.1-8b", "dummy").config
    fmt = WeightFormat(quantization, 2)
    one, = rank_memories(config, 1, fmt, 2)
    ranks = rank_memories(config, 4, fmt, 2)
    if quantization == "none":
        assert sum(r.layer_bytes for r in ranks) == one.layer_bytes
    assert all(r.global_bytes > config.vocab_size * config.hidden_size * 2 for r in ranks)
    assert sum(r.kv_bytes_per_token for r in ranks) == one.kv_bytes_per_token
    assert "rank 3: KV heads 6-7 (query heads 24-31)" in describe_ranks(ranks)
