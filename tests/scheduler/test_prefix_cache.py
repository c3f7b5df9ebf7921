"""Prefix caching and chunked prefill in the schedulers, in milliseconds (no torch): the block
pool's reference counts and LRU, chained hashes, hits capped below the last prompt token, and a
long randomised run over both KV tiers in which a fake KV cache checks that every token a share
reads was written for that very token and position, through chunks, shared blocks, swaps,
demotions and promotions, and that every block ends free or cached."""
import random

import pytest

from scheduler.block_pool import BlockPool
from scheduler.neo import NeoConfig, NeoScheduler
from scheduler.prefix_cache import PrefixCache, chain_hash, root_hash
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus, Tier
from test_neo_scheduler import make_cost_model

BLOCK_SIZE = 4
EOS = 2


def make_sequence(seq_id, prompt, max_tokens=6, request_id=None, **params):
    return Sequence(str(seq_id), list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                    eos_token_ids=(EOS,), request_id=request_id or str(seq_id))


def test_block_pool_counts_references_and_evicts_least_recently_freed():
    pool = BlockPool(4, BLOCK_SIZE)
    pool.records_evictions = True
    a, b, c = pool.allocate(3)
    pool.register(a, b"A")
    pool.register(b, b"B")
    pool.touch([a])  # shared by a second sequence
    pool.free([b, a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2 and pool.num_cached_blocks == 1
    assert pool.usage == pytest.approx(0.5)
    pool.free([a])  # cached now; b was freed first, so b goes first
    assert pool.lookup([b"A", b"B"]) == [a, b] and pool.num_cached_blocks == 2
    assert pool.allocate(2) == [3, b]  # the never-used block, then the least recently freed
    assert pool.take_evicted() == [(b, b"B")] and pool.lookup([b"A", b"B"]) == [a]
    pool.touch([a])  # a hit on a cached block takes it off the free list
    assert pool.num_free_blocks == 0 and pool.allocate(1) is None
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([c, c])


def test_hashes_chain_over_the_prefix_and_the_key():
    cache = PrefixCache(BLOCK_SIZE, "model-a")
    seq = make_sequence("s", range(10))
    first, second = cache.hashes(seq, 10)
    assert first == chain_hash(root_hash(f"model-a|block_size={BLOCK_SIZE}"), [0, 1, 2, 3])
    assert second == chain_hash(first, [4, 5, 6, 7])
    other = make_sequence("t", [9, 1, 2, 3, 4, 5, 6, 7])  # same second block, another first
    assert cache.hashes(other, 8)[1] != second
    assert PrefixCache(BLOCK_SIZE, "model-b").hashes(make_sequence("u", range(4)), 4)[0] != first


def test_hit_stops_short_of_the_last_prompt_token_and_skips_prompt_logprobs():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=32))
    first = make_sequence("a", range(8), max_tokens=1)
    sched.add_sequence(first)
    plan = sched.schedule()
    sched.update(plan, [5])
    assert first.finished
    same = make_sequence("b", range(8))  # two full blocks, but the second holds the last token
    sched.add_sequence(same)
    plan = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in plan.prefills] == [(4, 4)]
    sched.update(plan, [5])
    scored = make_sequence("c", range(9), prompt_logprobs=1)
    sched.add_sequence(scored)
    plan = sched.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in plan.prefills] == [(0, 9)]
    counters = sched.prefix_cache.counters
    assert counters.queries["gpu"] == 8 + 8 + 9 and counters.hits["gpu"] == 4


def test_counters_since_a_snapshot_are_one_iterations_share():
    """What the engine reports per iteration: the counts after a snapshot, which later counting
    leaves alone."""
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=32))
    sched.add_sequence(make_sequence("a", range(8), max_tokens=1))
    sched.update(sched.schedule(), [5])
    before = sched.prefix_cache.counters.snapshot()
    sched.add_sequence(make_sequence("b", range(9)))
    sched.schedule()
    share = sched.prefix_cache.counters.since(before)
    assert (share.queries, share.hits) == ({"gpu": 9, "cpu": 0}, {"gpu": 8, "cpu": 0})
    assert share.num_demoted_blocks == share.num_promoted_blocks == 0
    assert before.queries["gpu"] == 8 and before.hits["gpu"] == 0


def test_caching_off_computes_every_prompt():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=32,
                                      enable_prefix_caching=False))
    for name in "ab":
        sched.add_sequence(make_sequence(name, range(9), max_tokens=1))
        plan = sched.schedule()
        assert plan.prefills[0].num_computed_tokens == 0
        sched.update(plan, [5])
    assert sched.block_pool.num_cached_blocks == 0


class FakeKV:
    """What each block slot of each pool holds: the (token, position) whose K/V was written there.
    Runs a plan as the runner does: its copies in order, then every share's reads and writes."""

    def __init__(self) -> None:
        self.pools = {Tier.GPU: {}, Tier.CPU: {}}

    def run(self, plan) -> None:
        for copy in plan.copies:
            src, dst = (Tier.GPU, Tier.CPU) if copy.to_cpu else (Tier.CPU, Tier.GPU)
            for s, d in zip(copy.src_blocks, copy.dst_blocks):
                self.pools[dst][d] = list(self.pools[src].get(s, [None] * BLOCK_SIZE))
        for share in plan.scheduled:
            seq, pool = share.sequence, self.pools[share.sequence.tier]
            tokens = seq.all_token_ids
            for position in range(share.num_computed_tokens):  # what its attention reads
                slot = pool.get(seq.block_ids[position // BLOCK_SIZE], [None] * BLOCK_SIZE)[position % BLOCK_SIZE]
                assert slot == (tokens[position], position), (seq.seq_id, position, slot)
            for position in range(share.num_computed_tokens, share.num_computed_tokens + share.num_new_tokens):
                block = pool.setdefault(seq.block_ids[position // BLOCK_SIZE], [None] * BLOCK_SIZE)
                block[position % BLOCK_SIZE] = (tokens[position], position)


def check_references(sched) -> None:
    """Every block's count is the number of tables holding it (plus the host tier's pins)."""
    pools = {Tier.GPU: sched.block_pool, Tier.CPU: getattr(sched, "cpu_pool", None)}
    owners = [*sched.prefilling, *sched.running, *getattr(sched, "cpu_running", [])]
    for tier, pool in pools.items():
        if pool is None:
            continue
        expected = [0] * pool.num_blocks
        for seq in owners:
            if seq.tier is tier:
                for block in seq.block_ids:
                    expected[block] += 1
        if tier is Tier.CPU:
            for block in sched.host_tier._pinned:
                expected[block] += 1
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == expected
        assert pool.num_free_blocks == expected.count(0)


def make_prompt(rng):
    """One of three shared beginnings (some a few blocks long), then a short tail of its own."""
    start = rng.choice([[7] * 9, [8, 9] * 5, [10, 11, 12]])
    return start + [rng.randint(20, 40) for _ in range(rng.randint(1, 8))]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("two_tiers", [False, True])
def test_random_submit_abort_preempt_finish_reads_the_right_kv_and_frees_every_block(seed, two_tiers):
    config = SchedulerConfig(num_blocks=14, block_size=BLOCK_SIZE, max_model_len=40, max_num_seqs=6,
                             max_num_batched_tokens=10)
    if two_tiers:
        sched = NeoScheduler(config, NeoConfig(num_cpu_blocks=12, swap_cooldown_iterations=2), make_cost_model())
    else:
        sched = Scheduler(config)
    rng, kv = random.Random(seed), FakeKV()
    sequences, num_preempted, num_chunks = [], 0, 0
    for index in range(500):
        if index < 400 and rng.random() < 0.35:
            prompt, request = make_prompt(rng), f"r{index}"
            for sample in range(rng.choice([1, 1, 2])):  # n = 2 now and then
                seq = make_sequence(f"{request}#{sample}", prompt, max_tokens=rng.randint(1, 14), request_id=request)
                sequences.append(seq)
                sched.add_sequence(seq)
        if sequences and rng.random() < 0.05:
            sched.abort_sequences([rng.choice(sequences).seq_id])
        if not sched.has_unfinished_sequences():
            continue
        plan = sched.schedule()
        check_references(sched)
        kv.run(plan)
        num_preempted += len(plan.preempted)
        num_chunks += sum(1 for s in plan.prefills if not s.samples)
        sched.update(plan, [rng.choice((EOS, *range(20, 30))) for _ in plan.sampling])
    while sched.has_unfinished_sequences():
        plan = sched.schedule()
        kv.run(plan)
        sched.update(plan, [EOS] * len(plan.sampling))
    assert num_preempted > 0 and num_chunks > 0
    assert all(seq.status.finished for seq in sequences)
    assert sched.prefix_cache.counters.hits["gpu"] > 0
    if two_tiers:
        counters = sched.prefix_cache.counters
        assert sched.num_swap_out > 0 and sched.num_swap_in > 0
        assert counters.num_demoted_blocks > 0 and counters.num_promoted_blocks > 0 and counters.hits["cpu"] > 0
    for pool in (sched.block_pool, getattr(sched, "cpu_pool", None)):
        if pool is not None:  # every block free or cached: no count left behind
            assert pool.num_free_blocks == pool.num_blocks
            assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))
