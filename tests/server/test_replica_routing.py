"""The data-parallel front end's pieces that need no replica: prompt block digests, each replica's
index of what it was sent, the two routings, and /metrics merged from replicas."""
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import QueueBounds
from engine.config import EngineConfig
from engine.model_config import ConfigError
from server.metrics import Metrics
from server.replicas.metrics import merged_exposition
from server.replicas.router import (PrefixIndex, PrefixRouting, Replica, ReplicaSet, RoundRobinRouting, block_hashes,
                                    ROUTING_TYPES, create_routing, max_load, replica_set)
from server.replicas import ROUTINGS
from server.replicas.worker import ReplicaInfo


def replica(index: int, in_flight: int = 0, capacity: int = 100) -> Replica:
    info = ReplicaInfo(index, 1000 + index, "10.0.0.1", (index,), 2048, "bfloat16", capacity, 16, (2,))
    return Replica(info, actor=None, prefixes=PrefixIndex(capacity), num_in_flight=in_flight)


def test_block_digests_chain_whole_blocks_only():
    tokens = list(range(50))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 3  # the last 2 tokens make no block
    assert block_hashes(tokens[:48] + [7, 7], 16) == hashes
    changed = block_hashes([99] + tokens[1:], 16)
    assert all(a != b for a, b in zip(changed, hashes))  # a change early changes every later digest
    assert block_hashes(tokens[:10], 16) == []


def test_an_index_matches_leading_blocks_and_forgets_the_oldest():
    index = PrefixIndex(capacity_blocks=4)
    first, second = block_hashes(list(range(64))), block_hashes(list(range(100, 164)))
    index.add(first)
    assert index.matched_blocks(first) == 4
    assert index.matched_blocks(first[:2] + second[2:]) == 2
    assert index.matched_blocks(second) == 0
    index.add(second[:2])  # over capacity: the oldest two blocks go
    assert index.matched_blocks(first) == 0
    assert index.matched_blocks(second) == 2


def test_prefix_routing_follows_the_longest_prefix_then_the_load():
    routing, (a, b) = PrefixRouting(), (replica(0), replica(1))
    history = block_hashes(list(range(80)))
    b.prefixes.add(history[:3])
    a.prefixes.add(history[:1])
    assert routing.choose(history, [a, b]) is b
    b.num_in_flight = 1
    assert routing.choose(history, [a, b]) is b  # a cached history is worth a short queue
    b.num_in_flight = 2
    assert routing.choose(history, [a, b]) is a  # not a longer one
    a.num_in_flight, b.num_in_flight = 8, 11
    assert routing.choose(history, [a, b]) is b  # the allowance grows with the load
    assert max_load(0) == 1 and max_load(8) == 11


def test_conversations_sharing_a_system_prompt_spread_under_load():
    routing, replicas = PrefixRouting(), [replica(0), replica(1)]
    system = list(range(64))
    homes = []
    for conversation in range(6):  # each stays in flight
        hashes = block_hashes(system + [1000 + conversation] * 16)
        chosen = routing.choose(hashes, replicas)
        chosen.prefixes.add(hashes)
        chosen.num_in_flight += 1
        homes.append(chosen.info.index)
    assert sorted(homes) == [0, 0, 0, 1, 1, 1]


def test_prefix_routing_spreads_prompts_nobody_holds():
    routing, replicas = PrefixRouting(), [replica(0), replica(1)]
    chosen = [routing.choose([], replicas).info.index for _ in range(4)]
    assert chosen == [0, 1, 0, 1]
    replicas[0].num_in_flight = 2
    assert routing.choose([], replicas) is replicas[1]


def test_round_robin_takes_replicas_in_turn_whatever_they_hold():
    routing, replicas = RoundRobinRouting(), [replica(0), replica(1), replica(2)]
    history = block_hashes(list(range(64)))
    replicas[2].prefixes.add(history)
    assert [routing.choose(history, replicas).info.index for _ in range(4)] == [0, 1, 2, 0]


def test_an_unknown_routing_is_refused_by_its_flag():
    assert isinstance(create_routing("prefix"), PrefixRouting)
    assert set(ROUTING_TYPES) == set(ROUTINGS)  # the flag's choices are the routings built
    with pytest.raises(ConfigError, match="--data-parallel-routing"):
        create_routing("random")


def test_metrics_merge_replicas_under_their_label():
    replicas = []
    for index, tokens in enumerate((5, 7)):
        metrics = Metrics("m")
        metrics.generation_tokens.inc(tokens)
        replicas.append((index, metrics.render()))
    front = Metrics("m")
    front.record_api_request("/v1/completions", 200)
    families = {f.name: f for f in text_string_to_metric_families(merged_exposition(front.render(), replicas).decode())}
    generated = {s.labels["replica"]: s.value for s in families["tandem:generation_tokens"].samples
                 if s.name.endswith("_total")}
    assert generated == {"0": 5.0, "1": 7.0}  # the front end's own zero is not among them
    api = [s for s in families["tandem:api_requests"].samples if s.name.endswith("_total")]
    assert not any("replica" in s.labels for s in api)  # counted by the front end alone
    assert sum(s.value for s in api) == 1.0


@pytest.mark.parametrize("num_replicas, flags, message", [
    (0, {}, "--data-parallel-size must be an integer >= 1"),
    (2, {"tensor_parallel_size": 2}, "does not combine with --tensor-parallel-size"),
])
def test_replica_sets_that_cannot_work_are_refused_before_anything_starts(num_replicas, flags, message):
    config = EngineConfig.from_flat(model="smollm2-135m", **flags)
    with pytest.raises(ConfigError, match=message):
        replica_set(config, "m", QueueBounds(), num_replicas, "prefix")


def test_a_replica_set_runs_once_the_server_starts_it():
    """The server's lifespan starts what is not running: the set's health watcher among it."""
    replicas = ReplicaSet([replica(0)], front=None, routing=PrefixRouting(), bounds=QueueBounds())
    assert not replicas.is_running
    assert replicas.dead_reason is None  # not lost, not started
