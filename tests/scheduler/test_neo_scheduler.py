"""Neo's load-aware scheduler in milliseconds: plain seqs, a real TableCostModel built from
small explicit tables, fake sampled tokens. No torch."""
import random
import subprocess
import sys
from dataclasses import dataclass, fields

import pytest

from scheduler.planning.cost_model import Curve, Grid, TableCostModel
from scheduler.neo import NeoConfig, NeoScheduler
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import Sequence, SequenceStatus, Tier
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError
from scheduler.iteration_plan import IterationPlan, PlanMode

EOS = 2
BLOCK_SIZE = 4
TOLERANCE = 1e-12  # float slack when comparing stage times the scheduler summed in another order
SAMPLED = (EOS, *range(5, 25))  # fake sampled tokens: EOS one time in 21, so sequences run for a while


# ---- factories ------------------------------------------------------------------------------
def make_cost_model(cpu_seconds_per_token=2e-6, num_layers=4, linear_seconds=1e-3, linear_seconds_per_token=1e-7,
                    prefill_seconds_per_token=2e-7, gpu_seconds_per_token=1e-8, swap_seconds_per_block=1e-5,
                    handoff_seconds=0.0):
    """Per-layer times shaped like a memory-bound GPU beside a host CPU: the linear work is nearly
    flat in tokens (the weights are read once whatever the batch), decoding attention grows
    linearly with the context tokens it reads, much faster on the CPU than on the GPU."""
    max_tokens, max_seqs, max_context = 4096, 256, 65536
    cpu_seconds_per_seq = 1e-6
    return TableCostModel(
        num_layers=num_layers,
        linear_curve=Curve.from_points([(1, linear_seconds),
                                        (max_tokens, linear_seconds + max_tokens * linear_seconds_per_token)]),
        prefill_curve=Curve.from_points([(1, prefill_seconds_per_token),
                                         (max_tokens, max_tokens * prefill_seconds_per_token)]),
        gpu_decode_curve=Curve.from_points([(0, 0.0), (max_context, max_context * gpu_seconds_per_token)]),
        cpu_decode_grid=Grid((1.0, float(max_seqs)), (0.0, float(max_context)),
                             ((cpu_seconds_per_seq, cpu_seconds_per_seq + max_context * cpu_seconds_per_token),
                              (max_seqs * cpu_seconds_per_seq, max_seqs * cpu_seconds_per_seq
                               + max_context * cpu_seconds_per_token))),
        head_curve=Curve.from_points([(1, 1e-4), (max_seqs, 2e-4)]),
        swap_per_block=swap_seconds_per_block,
        handoff_seconds=handoff_seconds,
    )


def make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=48, max_num_seqs=32, cost_model=None,
                   watermark_blocks=1, enable_prefix_caching=False, **neo):
    # these prompts share prefixes; tests/scheduler/test_prefix_cache.py covers caching across the tiers
    config = SchedulerConfig(num_blocks=num_gpu_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, watermark_blocks=watermark_blocks,
                             enable_prefix_caching=enable_prefix_caching)
    return NeoScheduler(config, NeoConfig(num_cpu_blocks=num_cpu_blocks, **neo), cost_model or make_cost_model())


def make_sequence(seq_id, num_prompt_tokens=10, max_tokens=8, **params):
    return Sequence(str(seq_id), list(range(100, 100 + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(sched, token=7):
    """One iteration with a fake runner that samples `token` for every scheduled sequence."""
    plan = sched.schedule()
    check_blocks(sched)
    sched.update(plan, [token] * len(plan.sampling))
    return plan


def ids(seqs):
    return [s.sequence.seq_id for s in seqs]


def stage_times(plan, cost):
    """Neo's per-layer stage times of a plan, computed here from the plan alone."""
    prefill_lens = [s.num_new_tokens for s in plan.prefills]

    def context(seqs):  # a decode reads the KV of all its tokens, the new one included
        return sum(s.num_computed_tokens + s.num_new_tokens for s in seqs)

    return {
        "l0": cost.linear(sum(prefill_lens) + len(plan.decodes) + len(plan.batch0_cpu_decodes)),
        "l1": cost.linear(len(plan.batch1_cpu_decodes)),
        "ga0": (cost.prefill_attention(prefill_lens)
                + cost.gpu_decode_attention(len(plan.decodes), context(plan.decodes))),
        # a CPU stage pays its hand-offs (Q/K/V over, output back) on top of the attention
        "ca0": cost.cpu_decode_attention(len(plan.batch0_cpu_decodes), context(plan.batch0_cpu_decodes))
               + (cost.handoff() if plan.batch0_cpu_decodes else 0.0),
        "ca1": cost.cpu_decode_attention(len(plan.batch1_cpu_decodes), context(plan.batch1_cpu_decodes))
               + (cost.handoff() if plan.batch1_cpu_decodes else 0.0),
        # the CPU's share of each linear stage (sliced MLPs), in the other sub-batch's attention window
        "cl0": cost.cpu_linear(sum(prefill_lens) + len(plan.decodes) + len(plan.batch0_cpu_decodes)),
        "cl1": cost.cpu_linear(len(plan.batch1_cpu_decodes)),
    }


def estimated_time(plan, cost):
    """The iteration time Neo 3.2 estimates for the plan's mode, from the plan alone."""
    t = stage_times(plan, cost)
    moved = sum(len(s.src_blocks) for s in (*plan.swap_out, *plan.swap_in))
    if plan.mode == PlanMode.PIPELINED:
        per_layer = max(t["l0"], t["cl0"] + t["ca1"]) + max(t["l1"] + t["ga0"], t["cl1"] + t["ca0"])
    else:
        per_layer = t["l0"] + t["ga0"]
    return cost.num_layers * per_layer + cost.head(len(plan.scheduled)) + cost.swap(moved)


def check_blocks(sched):
    """After schedule(): no block owned twice, owned + free = pool size in both pools, every
    running sequence's blocks cover all its tokens and sit in the pool of its tier."""
    for pool, queue, tier in ((sched.block_pool, sched.running, Tier.GPU),
                              (sched.cpu_pool, sched.cpu_running, Tier.CPU)):
        prefilling = [r for r in sched.prefilling if r.tier is tier]
        owned = [b for r in (*queue, *prefilling) for b in r.block_ids]
        assert len(owned) == len(set(owned)), "a block owned twice"
        assert all(0 <= b < pool.num_blocks for b in owned)
        pinned = len(sched.host_tier._pinned) if tier is Tier.CPU else 0
        assert len(owned) + pool.num_free_blocks + pinned == pool.num_blocks
        for r in queue:
            assert r.tier is tier and r.status is SequenceStatus.RUNNING
            assert len(r.block_ids) * BLOCK_SIZE >= r.num_tokens
    assert all(not r.block_ids and r.status is SequenceStatus.WAITING for r in sched.waiting)


def check_plan(plan, cost):
    """Per-plan invariants every test relies on."""
    if plan.mode == PlanMode.GPU_ONLY:  # the CPU never works while ... there is no pipeline to hide it
        assert not plan.batch0_cpu_decodes and not plan.batch1_cpu_decodes and not plan.forced
    elif not plan.forced:  # both of Neo's inequalities
        t = stage_times(plan, cost)
        assert t["cl0"] + t["ca1"] <= t["l0"] + TOLERANCE
        assert t["cl1"] + t["ca0"] <= t["l1"] + t["ga0"] + TOLERANCE
    assert not (plan.swap_in and plan.swap_out), "one copy direction per plan"
    for swap in (*plan.swap_out, *plan.swap_in):
        assert len(swap.src_blocks) == len(swap.dst_blocks)
        assert tuple(swap.sequence.block_ids[:len(swap.dst_blocks)]) == swap.dst_blocks
    for scheduled in plan.prefills:  # a prefill bound for the host pool starts at 0 (the runner's rule)
        assert scheduled.sequence.tier is Tier.GPU or scheduled.num_computed_tokens == 0
    for scheduled in plan.decodes:
        assert scheduled.sequence.tier is Tier.GPU
    for scheduled in (*plan.batch0_cpu_decodes, *plan.batch1_cpu_decodes):
        assert scheduled.sequence.tier is Tier.CPU
    assert len({id(s.sequence) for s in plan.scheduled}) == len(plan.scheduled)
    assert plan.estimated_time == pytest.approx(estimated_time(plan, cost), rel=1e-9)


def run_trace(sched, seed, num_steps=300, arrival_rate=0.8, abort_rate=0.03, max_prompt=30, max_output=30,
              sampled=SAMPLED):
    """Random arrivals, prompt and output lengths, aborts and EOS; checks every plan and the
    block accounting, drains the scheduler and returns [(plan, tokens received per seq)]."""
    rng = random.Random(seed)
    seqs, history = [], []
    for index in range(num_steps):
        if rng.random() < arrival_rate:
            seq = make_sequence(f"r{len(seqs)}", rng.randint(1, max_prompt), rng.randint(1, max_output))
            seqs.append(seq)
            sched.add_sequence(seq)
        if rng.random() < abort_rate:
            live = [r for r in seqs if not r.finished]
            if live:
                sched.abort_sequences([rng.choice(live).seq_id])
        plan = sched.schedule()
        check_blocks(sched)
        check_plan(plan, sched.cost_model)
        history.append(plan)
        sched.update(plan, [rng.choice(sampled) for _ in plan.scheduled])
    while sched.has_unfinished_sequences():
        plan = sched.schedule()
        check_blocks(sched)
        check_plan(plan, sched.cost_model)
        history.append(plan)
        sched.update(plan, [rng.choice(sampled) for _ in plan.scheduled])
        assert len(history) < num_steps * 50, "the scheduler stopped making progress"
    assert all(r.finished and not r.block_ids for r in seqs)
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks
    assert sched.cpu_pool.num_free_blocks == sched.cpu_pool.num_blocks
    return history


# ---- basics ---------------------------------------------------------------------------------
def test_neo_does_not_import_torch():
    code = "import sys, scheduler.neo; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_config_validation():
    for kwargs, name in [({"num_cpu_blocks": -1}, "num_cpu_blocks"), ({"swap_in_reserve_fraction": 1.0}, "fraction"),
                         ({"swap_in_reserve_fraction": -0.1}, "fraction"), ({"max_cpu_wait_iterations": 0}, "wait"),
                         ({"swap_cooldown_iterations": 1.5}, "cooldown"), ({"cpu_watermark_blocks": -1}, "watermark")]:
        with pytest.raises(SchedulerConfigError, match=name):
            NeoConfig(**kwargs)
    with pytest.raises(Exception):
        NeoConfig().num_cpu_blocks = 3  # frozen


# ---- exact GPU-only behaviour without a host pool ---------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_empty_host_pool_reproduces_v0(seed, caching):
    config = SchedulerConfig(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=40, max_num_seqs=6, watermark_blocks=1,
                             max_num_batched_tokens=24, enable_prefix_caching=caching)
    v0 = Scheduler(config)
    neo = NeoScheduler(config, NeoConfig(num_cpu_blocks=0), make_cost_model())
    rng = random.Random(seed)
    pairs, num_preempted = [], 0
    for index in range(400):
        if len(pairs) < 60 and rng.random() < 0.4:
            num_prompt_tokens, max_tokens = rng.randint(1, 20), rng.randint(1, 20)  # max_model_len 40
            prompt = [rng.choice((100, 101)) for _ in range(num_prompt_tokens)]  # a few shared prefixes
            pair = tuple(Sequence(f"r{len(pairs)}", list(prompt), SamplingParams(max_tokens=max_tokens),
                                  eos_token_ids=(EOS,)) for _ in range(2))
            pairs.append(pair)
            v0.add_sequence(pair[0])
            neo.add_sequence(pair[1])
        if rng.random() < 0.04:
            victim = rng.choice(pairs)[0].seq_id
            assert ids_of(v0.abort_sequences([victim])) == ids_of(neo.abort_sequences([victim]))
        expected, plan = v0.schedule(), neo.schedule()
        for name in ("prefills", "decodes"):
            assert shape(getattr(plan, name)) == shape(getattr(expected, name)), (index, name)
        assert ids_of(plan.preempted) == ids_of(expected.preempted)
        assert plan.mode == PlanMode.GPU_ONLY and not (plan.batch0_cpu_decodes or plan.batch1_cpu_decodes
                                                       or plan.swap_in
                                                       or plan.swap_out or plan.forced)
        assert ids_of(neo.waiting) == ids_of(v0.waiting) and ids_of(neo.running) == ids_of(v0.running)
        assert neo.block_pool.num_free_blocks == v0.block_pool.num_free_blocks
        num_preempted += len(plan.preempted)
        tokens = [rng.choice(SAMPLED) for _ in expected.scheduled]
        assert ids_of(v0.update(expected, tokens)) == ids_of(neo.update(plan, tokens))
    assert num_preempted > 0, "the trace must exercise preemption"
    assert neo.num_preemptions == v0.num_preemptions and neo.num_swap_out == neo.num_swap_in == 0


def ids_of(seqs):
    return [r.seq_id for r in seqs]


def shape(seqs):
    return [(s.sequence.seq_id, s.num_computed_tokens, s.num_new_tokens) for s in seqs]


# ---- invariants over long random traces ---------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cpu_seconds_per_token", [2e-6, 2e-5])
def test_random_traces_keep_both_inequalities_and_account_every_block(seed, cpu_seconds_per_token):
    # a GPU pool for a few seqs, a host pool for many; CPU attention cheap enough that batch-1
    # takes every CPU decode, or dear enough that batch-0 takes some and GPU-only plans win often
    sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=96, max_model_len=64, max_num_seqs=24,
                           cost_model=make_cost_model(cpu_seconds_per_token=cpu_seconds_per_token))
    history = run_trace(sched, seed)
    modes = {plan.mode for plan in history}
    assert modes == {PlanMode.GPU_ONLY, PlanMode.PIPELINED}, "the trace must exercise both plans"
    assert any(plan.batch1_cpu_decodes for plan in history)
    if cpu_seconds_per_token > 1e-5:
        assert any(plan.batch0_cpu_decodes for plan in history)
    assert sched.num_swap_out > 0 and sched.num_swap_in > 0 and sched.num_cpu_prefills > 0
    assert sched.num_running == 0 and not sched.has_unfinished_sequences()


@pytest.mark.parametrize("seed", range(3))
def test_random_traces_with_tiny_host_pool_preempt_and_still_finish(seed):
    # the host pool fills too: seqs are preempted (recomputed) from both tiers
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=16, max_model_len=48, max_num_seqs=16)
    run_trace(sched, seed, arrival_rate=0.7, abort_rate=0.0, sampled=(5, 6, 7))  # no EOS: all run long
    assert sched.num_preemptions > 0 and sched.num_swap_out > 0


# ---- never CPU busy while the GPU idles ------------------------------------------------------------
def test_gpu_only_plans_run_no_cpu_work_and_pipelined_stages_overlap():
    for cpu_seconds_per_token in (1e-7, 2e-6, 2e-5):
        sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=96, max_model_len=64,
                               cost_model=make_cost_model(cpu_seconds_per_token=cpu_seconds_per_token))
        for plan in run_trace(sched, seed=11, num_steps=200):
            t = stage_times(plan, sched.cost_model)
            if plan.mode == PlanMode.GPU_ONLY:
                assert t["ca0"] == t["ca1"] == 0.0
            elif not plan.forced:
                # the CPU's stage never outlasts the GPU work it runs beside
                assert t["ca1"] <= t["l0"] + TOLERANCE and t["ca0"] <= t["l1"] + t["ga0"] + TOLERANCE


@pytest.mark.parametrize("handoff_seconds", [0.0, 2e-4, 2e-3])
def test_hand_offs_count_against_the_cpu_stages(handoff_seconds):
    """The hand-off of each CPU stage lengthens it: with a hand-off longer than batch-0's linear
    work nothing hides under it and only overdue sequences are ever placed (forced); shorter ones
    still pipeline, with both inequalities holding hand-offs included."""
    cost = make_cost_model(cpu_seconds_per_token=1e-7, handoff_seconds=handoff_seconds)
    sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=96, max_model_len=64, cost_model=cost)
    modes = set()
    for plan in run_trace(sched, seed=5, num_steps=150):
        if not plan.forced:
            modes.add(plan.mode)
        if plan.mode == PlanMode.PIPELINED and not plan.forced:
            t = stage_times(plan, cost)
            assert t["ca1"] <= t["l0"] + TOLERANCE and t["ca0"] <= t["l1"] + t["ga0"] + TOLERANCE
    assert (PlanMode.PIPELINED in modes) == (handoff_seconds < cost.linear(1))


# ---- greedy plan choice --------------------------------------------------------------------------
def fill_both_tiers(cost_model):
    """A GPU pool that holds five sequences and seven more on the host, all decoding."""
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=32, cost_model=cost_model)
    seqs = [make_sequence(i, num_prompt_tokens=11, max_tokens=20) for i in range(12)]
    for seq in seqs:
        sched.add_sequence(seq)
    plan = step(sched)
    # 3 blocks each and a watermark block: 5 on the GPU
    assert sum(r.tier is Tier.GPU for r in seqs) == 5 and sum(r.tier is Tier.CPU for r in seqs) == 7
    return sched, plan


@pytest.mark.parametrize("cpu_seconds_per_token, expected", [(1e-6, PlanMode.PIPELINED),
                                                               (5e-5, PlanMode.GPU_ONLY),
                                                               (1e-3, PlanMode.GPU_ONLY)])
def test_greedy_choice_follows_estimated_throughput(cpu_seconds_per_token, expected):
    cost = make_cost_model(cpu_seconds_per_token=cpu_seconds_per_token)
    sched, _ = fill_both_tiers(cost)
    plan = sched.schedule()
    check_plan(plan, cost)
    assert plan.mode == expected
    best_pipelined = max(sched.last_pipelined_throughput, sched.last_one_batch_throughput)
    assert (best_pipelined > sched.last_gpu_only_throughput) == (plan.mode == PlanMode.PIPELINED)
    chosen = max(best_pipelined, sched.last_gpu_only_throughput)
    assert chosen == pytest.approx(len(plan.scheduled) / plan.estimated_time)
    if cpu_seconds_per_token == 1e-6:  # all seven CPU-sequences hide under batch-0's linear work
        assert len(plan.batch1_cpu_decodes) == 7
    elif cpu_seconds_per_token == 5e-5:
        # some CPU decodes fit the inequalities, yet too few to pay for the second stage
        assert 0 < sched.last_pipelined_throughput < sched.last_gpu_only_throughput
    else:  # none fits: the pipelined plan is the GPU-only plan
        assert sched.last_pipelined_throughput == sched.last_gpu_only_throughput


@pytest.mark.parametrize("ga_seconds_per_token, expected_batch0", [(1e-8, 0), (2e-6, 3), (1e-5, 3)])
def test_one_batch_plan_when_a_second_weight_pass_does_not_pay(ga_seconds_per_token, expected_batch0):
    """Three CPU-sequences beside five GPU-sequences: Neo's step 4 opens batch-1 for them, which
    costs a second pass over the weights (T_l1 = 1 ms a layer). When the GPU's attention
    (T_ga0) is long enough to hide them in batch-0, the one-batch plan carries them at almost no
    cost and wins over both; when it is not, they wait under GPU-only."""
    cost = make_cost_model(cpu_seconds_per_token=1e-6, gpu_seconds_per_token=ga_seconds_per_token)
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=32, cost_model=cost)
    seqs = [make_sequence(i, num_prompt_tokens=11, max_tokens=20) for i in range(8)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)
    assert sum(r.tier is Tier.CPU for r in seqs) == 3
    plan = sched.schedule()
    check_plan(plan, cost)
    assert sched.last_pipelined_throughput < sched.last_gpu_only_throughput  # batch-1 does not pay
    assert not plan.batch1_cpu_decodes and len(plan.batch0_cpu_decodes) == expected_batch0
    if expected_batch0:
        assert plan.mode == PlanMode.PIPELINED
        assert sched.last_one_batch_throughput == pytest.approx(len(plan.scheduled) / plan.estimated_time)
        assert sched.last_one_batch_throughput > sched.last_gpu_only_throughput
        t = stage_times(plan, cost)
        assert t["ca0"] <= t["ga0"] + TOLERANCE  # hidden under the GPU's attention alone
    else:
        assert plan.mode == PlanMode.GPU_ONLY and sched.last_one_batch_throughput == 0


def test_no_cpu_request_means_gpu_only():
    sched = make_scheduler(num_gpu_blocks=64)
    for i in range(4):
        sched.add_sequence(make_sequence(i))
    for _ in range(5):
        plan = step(sched)
        assert plan.mode == PlanMode.GPU_ONLY and sched.num_cpu_running == 0
        assert sched.last_pipelined_throughput == sched.last_gpu_only_throughput > 0


# ---- GPU filled first -------------------------------------------------------------------------
def test_prefills_fill_the_gpu_first_then_go_to_the_host_pool():
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=32)
    seqs = [make_sequence(i, num_prompt_tokens=11, max_tokens=20) for i in range(6)]
    for seq in seqs:
        sched.add_sequence(seq)
    plan = sched.schedule()
    # 3 blocks each; the GPU keeps a watermark block: 5 fit in 16 blocks, the sixth goes to the host
    assert ids(plan.prefills) == ["0", "1", "2", "3", "4", "5"]
    assert [r.tier for r in seqs] == [Tier.GPU] * 5 + [Tier.CPU]
    assert sched.num_gpu_running == 5 and sched.num_cpu_running == 1 and sched.num_cpu_prefills == 1
    assert sched.block_pool.num_free_blocks == 1 and sched.cpu_pool.num_free_blocks == 61
    assert plan.mode == PlanMode.GPU_ONLY  # nothing to decode on the CPU yet


def test_swap_in_oldest_first_when_room_appears():
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=32, swap_in_reserve_fraction=0.1,
                           swap_cooldown_iterations=4)
    seqs = [make_sequence(i, num_prompt_tokens=11, max_tokens=20) for i in range(8)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)
    assert [r.tier for r in seqs] == [Tier.GPU] * 5 + [Tier.CPU] * 3
    sched.abort_sequences(["0", "1", "2"])  # 9 GPU blocks come free: 10 free
    plan = step(sched)
    # a CPU-sequence of 12 tokens holds 3 blocks and grows by 1 over the 4-iteration cooldown, as
    # does each GPU-sequence; the reserve is ceil(0.1 * 16) = 2 blocks, the watermark 1.
    # "5": 3 + 1 + growth 2 + 2 + 1 = 9 <= 10 comes in; "6": 3 + 1 + 3 + 2 + 1 = 10 > 7 waits
    assert ids(plan.swap_in) == ["5"] and seqs[5].tier is Tier.GPU
    assert ids(plan.decodes) == ["3", "4", "5"] and sched.num_swap_in == 1 and sched.num_swap_in_blocks == 3
    assert plan.swap_in[0].dst_blocks == tuple(seqs[5].block_ids)
    plan = step(sched)
    assert not plan.swap_in
    sched.abort_sequences(["3", "4"])
    plan = step(sched)
    assert ids(plan.swap_in) == ["6", "7"] and sched.num_cpu_running == 0


def test_swap_out_newest_when_the_gpu_cannot_hold_new_kv():
    sched = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=64, max_model_len=32, watermark_blocks=0)
    seqs = [make_sequence(i, num_prompt_tokens=12, max_tokens=20) for i in range(4)]
    for seq in seqs:
        sched.add_sequence(seq)
    plan = step(sched)  # 3 blocks each, all 12 GPU blocks used
    assert [r.tier for r in seqs] == [Tier.GPU] * 4 and sched.block_pool.num_free_blocks == 0
    gpu_blocks = list(seqs[3].block_ids)
    plan = sched.schedule()  # token 13 needs a 4th block each: the newest makes room for the others
    check_plan(plan, sched.cost_model)
    assert ids(plan.swap_out) == ["3"] and not plan.preempted
    swap = plan.swap_out[0]
    assert list(swap.src_blocks) == gpu_blocks and seqs[3].tier is Tier.CPU
    assert seqs[3].block_ids[:3] == list(swap.dst_blocks) and len(seqs[3].block_ids) == 4
    assert ids(plan.decodes) == ["0", "1", "2"] and sched.num_swap_out == 1 and sched.num_swap_out_blocks == 3
    # it was placed on the CPU this very iteration (the pipelined estimate counts it), but one CPU
    # decode does not pay for a second stage: GPU-only wins and it waits
    assert sched.last_pipelined_throughput < sched.last_gpu_only_throughput and plan.mode == PlanMode.GPU_ONLY
    assert sched.last_pipelined_throughput == pytest.approx(4 / (
        estimated_time(plan, sched.cost_model) + sched.cost_model.num_layers * sched.cost_model.linear(1)
        + sched.cost_model.head(4) - sched.cost_model.head(3)))
    assert seqs[3].cpu_wait_iterations == 1


def test_preempts_when_the_host_pool_is_full_too():
    sched = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=3, max_model_len=32, watermark_blocks=0)
    seqs = [make_sequence(i, num_prompt_tokens=8, max_tokens=20) for i in range(6)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)  # 2 blocks each: the GPU pool is full
    sched.add_sequence(make_sequence("late", num_prompt_tokens=1))
    plan = sched.schedule()
    # token 9 needs a 3rd block each (6 short): the newest goes to the host pool (3 blocks with its
    # next token), which then has no room for the next newest: that one is preempted
    assert ids(plan.swap_out) == ["5"] and ids_of(plan.preempted) == ["4"]
    assert seqs[4].status is SequenceStatus.WAITING and seqs[4].num_computed_tokens == 0
    assert ids_of(sched.waiting) == ["4", "late"] and sched.num_preemptions == 1
    assert not plan.prefills  # none in an iteration that had to preempt (v0's rule)
    check_blocks(sched)


def test_cpu_request_growth_preempts_the_newest_cpu_request():
    sched = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=6, max_model_len=32, cpu_watermark_blocks=0,
                           cost_model=make_cost_model(cpu_seconds_per_token=1e-7))
    seqs = [make_sequence(i, num_prompt_tokens=12, max_tokens=20) for i in range(4)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)  # two on the GPU (3 blocks + watermark), two on the host (3 blocks each: full)
    assert [r.tier for r in seqs] == [Tier.GPU, Tier.GPU, Tier.CPU, Tier.CPU]
    plan = sched.schedule()  # both CPU-sequences need a 4th host block: the newest yields
    assert seqs[3] in plan.preempted and seqs[3].status is SequenceStatus.WAITING
    assert seqs[2].tier is Tier.CPU and len(seqs[2].block_ids) == 4
    check_blocks(sched)


# ---- bounded wait -------------------------------------------------------------------------------
@pytest.mark.parametrize("max_wait", [1, 3, 6])
def test_bounded_wait_even_when_cpu_attention_looks_terrible(max_wait):
    cost = make_cost_model(cpu_seconds_per_token=1.0)  # never worth pipelining, never fits
    # backpressure loosened so prefills keep joining the host pool: the bound must hold for them too
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=128, max_model_len=48, cost_model=cost,
                           max_cpu_wait_iterations=max_wait, cpu_admission_wait_fraction=0.99)
    rng = random.Random(max_wait)
    last_token, seqs, num_forced = {}, [], 0
    for iteration in range(300):
        if rng.random() < 0.4:
            seq = make_sequence(f"r{iteration}", rng.randint(4, 20), rng.randint(5, 25))
            seqs.append(seq)
            sched.add_sequence(seq)
        plan = sched.schedule()
        check_plan(plan, cost)
        num_forced += len(plan.forced)
        for seq in plan.forced:
            assert plan.mode == PlanMode.PIPELINED
            assert seq in [s.sequence for s in plan.batch0_cpu_decodes + plan.batch1_cpu_decodes]
        for updated in sched.update(plan, [5] * len(plan.sampling)):
            last_token[updated.seq_id] = iteration
        # one overdue sequence is forced per iteration, longest waiting first: a sequence waits at
        # most max_wait iterations plus one for each overdue sequence ahead of it
        for seq in sched.cpu_running:
            assert iteration - last_token[seq.seq_id] <= max_wait + len(sched.cpu_running), seq.seq_id
        assert len(plan.forced) <= sched.neo.max_forced_cpu_decodes or not (plan.decodes or plan.prefills)
    assert num_forced > 0 and sched.num_cpu_prefills > 0


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_host_admission_backs_off_while_the_cpu_runqueue_is_served_slowly(fraction):
    """A CPU whose attention never fits serves only the overdue sequence forced each iteration:
    prefills then enter the host pool only while the runqueue, at that rate, waits at most
    `fraction` of the bound."""
    max_wait = 8
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=512, max_model_len=48, max_num_seqs=64,
                           cost_model=make_cost_model(cpu_seconds_per_token=1.0), max_cpu_wait_iterations=max_wait,
                           cpu_admission_wait_fraction=fraction)
    num_refused = 0
    for i in range(80):  # one arrival per iteration
        sched.add_sequence(make_sequence(i, num_prompt_tokens=11, max_tokens=30))
        cap = sched.max_cpu_admitted
        plan = step(sched, token=5)
        if any(s.sequence.tier is Tier.CPU for s in plan.prefills):
            assert sched.num_cpu_running - 1 < cap  # the last one admitted saw one CPU-sequence fewer
        elif sched.waiting and sched.cpu_pool.num_free_blocks > 16 and sched.num_running < 64:
            num_refused += 1  # the host pool had room, the runqueue had work enough
    rate = sched.cpu_service_rate
    assert rate is not None and 0 < rate <= sched.neo.max_forced_cpu_decodes
    assert sched.max_cpu_admitted == pytest.approx(max(1.0, rate * fraction * max_wait))
    assert num_refused > 0


def test_a_plan_never_idles_while_cpu_requests_wait():
    # CPU attention too slow to fit anywhere, the CPU-sequence in cooldown: the GPU-sequences leave and
    # the plan must still schedule it rather than come back empty
    cost = make_cost_model(cpu_seconds_per_token=1.0)
    sched = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=64, max_model_len=32, watermark_blocks=0, cost_model=cost,
                           swap_cooldown_iterations=100, max_cpu_wait_iterations=50)
    seqs = [make_sequence(i, num_prompt_tokens=12, max_tokens=30) for i in range(4)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)
    plan = step(sched)
    assert ids(plan.swap_out) == ["3"]
    sched.abort_sequences(["0", "1", "2"])
    for _ in range(5):
        plan = sched.schedule()
        check_plan(plan, cost)
        assert not plan.swap_in and not plan.decodes  # cooldown
        # the engine runs it on the CPU in batch-0 (a pipelined forward needs a batch-0)
        assert ids(plan.batch0_cpu_decodes) == ["3"] and ids_of(plan.forced) == ["3"] and plan.mode == PlanMode.PIPELINED
        sched.update(plan, [5] * len(plan.sampling))


# ---- no swap ping-pong ------------------------------------------------------------------------------
def oscillating_run(seed, **neo):
    """Waves of sequences whose KV grows past the GPU pool and shrinks below it as they finish
    (some early, by EOS, freeing room all at once).
    Returns the scheduler and each sequence's moves [(iteration, 'out' | 'in')]."""
    sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=128, max_model_len=64, max_num_seqs=32,
                           cost_model=make_cost_model(cpu_seconds_per_token=1e-6), **neo)
    rng = random.Random(seed)
    moves = {}
    for iteration in range(400):
        if iteration % 40 < 8:  # a burst, then a lull
            sched.add_sequence(make_sequence(f"r{iteration}", rng.randint(8, 16), rng.randint(20, 44)))
        plan = sched.schedule()
        check_blocks(sched)
        check_plan(plan, sched.cost_model)
        for direction, swaps in (("out", plan.swap_out), ("in", plan.swap_in)):
            for swap in swaps:
                moves.setdefault(swap.sequence.seq_id, []).append((sched.iteration, direction))
        sched.update(plan, [rng.choice(SAMPLED) for _ in plan.scheduled])  # EOS frees room suddenly
    return sched, moves


@pytest.mark.parametrize("seed", range(6))
def test_no_swap_ping_pong(seed):
    cooldown = 16
    sched, moves = oscillating_run(seed, swap_cooldown_iterations=cooldown, max_cpu_wait_iterations=10 * cooldown)
    assert sched.num_swap_out > 0 and sched.num_swap_in > 0
    for seq_id, history in moves.items():
        for (earlier, _), (later, _) in zip(history, history[1:]):
            assert later - earlier >= cooldown, (seq_id, history)
    # the hysteresis matters: without reserve and cooldown the same workload moves far more
    baseline, _ = oscillating_run(seed, swap_cooldown_iterations=0, swap_in_reserve_fraction=0.0,
                                  max_cpu_wait_iterations=10 * cooldown)
    num_moves = sched.num_swap_out + sched.num_swap_in
    assert num_moves < baseline.num_swap_out + baseline.num_swap_in
    assert max(len(history) for history in moves.values()) <= 400 // cooldown + 1


# ---- step 5: CPU-bound prefills ------------------------------------------------------------------------
def host_heavy_scheduler(num_cpu_requests):
    """Two GPU-sequences filling the GPU pool and `num_cpu_requests` CPU-sequences decoding."""
    cost = make_cost_model(cpu_seconds_per_token=4e-6, prefill_seconds_per_token=1e-8)
    sched = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=256, max_model_len=32, watermark_blocks=0, cost_model=cost,
                           cpu_watermark_blocks=0)
    seqs = [make_sequence(i, num_prompt_tokens=14, max_tokens=16) for i in range(2 + num_cpu_requests)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)
    assert sum(r.tier is Tier.CPU for r in seqs) == num_cpu_requests
    return sched, cost


def test_cpu_bound_prefill_dropped_when_the_cpu_has_work_enough():
    sched, cost = host_heavy_scheduler(num_cpu_requests=20)
    late = make_sequence("late", num_prompt_tokens=14)
    sched.add_sequence(late)
    free_before = sched.cpu_pool.num_free_blocks  # the CPU-sequences need no new block this iteration
    num_cpu_prefills = sched.num_cpu_prefills
    plan = sched.schedule()
    check_plan(plan, cost)
    # the CPU has more decode work than batch-0's linear stage and the inequalities hold without
    # the prefill: it only lengthens the GPU's side, so it waits
    assert plan.mode == PlanMode.PIPELINED and plan.batch0_cpu_decodes and plan.batch1_cpu_decodes and not plan.prefills
    assert list(sched.waiting) == [late] and late.status is SequenceStatus.WAITING and not late.block_ids
    assert sched.cpu_pool.num_free_blocks == free_before and sched.num_cpu_prefills == num_cpu_prefills
    check_blocks(sched)
    cpu_work = cost.cpu_decode_attention(20, sum(r.num_tokens for r in sched.cpu_running))
    assert cpu_work >= stage_times(plan, cost)["l0"]


@pytest.mark.parametrize("num_cpu_requests", [4, 12])
def test_cpu_bound_prefill_kept_while_the_cpu_would_run_dry(num_cpu_requests):
    sched, cost = host_heavy_scheduler(num_cpu_requests)
    late = make_sequence("late", num_prompt_tokens=14)
    sched.add_sequence(late)
    num_cpu_prefills = sched.num_cpu_prefills
    plan = sched.schedule()
    check_plan(plan, cost)
    assert ids(plan.prefills) == ["late"] and late.tier is Tier.CPU and late in sched.cpu_running
    assert not sched.waiting and sched.num_cpu_prefills == num_cpu_prefills + 1
    # the paper's rule would drop it (the CPU decodes fit beside batch-0 without it), but the
    # CPU-sequences hold less decode work than one linear stage: the CPU needs more sequences
    without = IterationPlan(decodes=plan.decodes, batch0_cpu_decodes=plan.batch0_cpu_decodes,
                            batch1_cpu_decodes=plan.batch1_cpu_decodes)
    t = stage_times(without, cost)
    assert plan.batch1_cpu_decodes and t["ca1"] <= t["l0"] and t["ca0"] <= t["l1"] + t["ga0"]
    decoding = [r for r in sched.cpu_running if r is not late]
    assert cost.cpu_decode_attention(len(decoding), sum(r.num_tokens for r in decoding)) < stage_times(plan, cost)["l0"]


# ---- plan order and results ------------------------------------------------------------------------------
def test_scheduled_order_matches_update():
    """Every plan's `scheduled` order (prefills, GPU decodes, batch-0 CPU decodes, batch-1) is the
    order update() hands the sampled tokens out in."""
    sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=96, max_model_len=64,
                           cost_model=make_cost_model(cpu_seconds_per_token=2e-5))
    rng = random.Random(5)
    num_complete = 0
    for index in range(200):
        if rng.random() < 0.8:
            sched.add_sequence(make_sequence(f"r{index}", rng.randint(1, 30), rng.randint(1, 30)))
        plan = sched.schedule()
        expected = plan.prefills + plan.decodes + plan.batch0_cpu_decodes + plan.batch1_cpu_decodes
        assert [id(s) for s in plan.scheduled] == [id(s) for s in expected]
        num_complete += bool(plan.prefills and plan.decodes and plan.batch0_cpu_decodes and plan.batch1_cpu_decodes)
        tokens = [1000 + i for i in range(len(plan.scheduled))]
        assert sched.update(plan, tokens) == [s.sequence for s in plan.scheduled]
        for scheduled, token in zip(plan.scheduled, tokens):
            assert scheduled.sequence.output_token_ids[-1] == token
            assert scheduled.sequence.num_computed_tokens == scheduled.num_computed_tokens + scheduled.num_new_tokens
    assert num_complete > 0, "some plan must use all four parts"


def test_finish_and_abort_free_blocks_in_the_right_pool():
    sched = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=64, max_model_len=32)
    seqs = [make_sequence(i, num_prompt_tokens=11, max_tokens=3) for i in range(7)]
    for seq in seqs:
        sched.add_sequence(seq)
    step(sched)
    assert seqs[6].tier is Tier.CPU and seqs[5].tier is Tier.CPU
    aborted = sched.abort_sequences(["6", "0", "missing"])
    assert sorted(ids_of(aborted)) == ["0", "6"] and all(r.status is SequenceStatus.FINISHED_ABORTED for r in aborted)
    sched.finish_sequence(seqs[5], SequenceStatus.FINISHED_STOPPED)
    assert sched.num_cpu_running == 0 and sched.cpu_pool.num_free_blocks == 64
    check_blocks(sched)
    while sched.has_unfinished_sequences():  # the rest finish by length
        step(sched)
    assert sched.block_pool.num_free_blocks == 16 and sched.num_running == 0


# ---- the CPU's share of sliced MLPs (ScheInfer's CC) ---------------------------------------------
@dataclass(frozen=True)
class CpuSharedLinearCosts(TableCostModel):
    """The tables, with the CPU computing `cpu_share` of every linear stage itself (CC slices)."""

    cpu_share: float = 0.0

    def cpu_linear(self, num_tokens: int) -> float:
        return self.cpu_share * self.linear(num_tokens) if num_tokens > 0 else 0.0


def cpu_shared(cost: TableCostModel, cpu_share: float) -> CpuSharedLinearCosts:
    return CpuSharedLinearCosts(**{f.name: getattr(cost, f.name) for f in fields(cost)}, cpu_share=cpu_share)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("cpu_share", [0.3, 0.8])
def test_cpu_share_of_linear_stages_counts_against_the_cpu_window(seed, cpu_share):
    """With the CPU computing part of every linear stage, less of its attention hides under the
    GPU: both inequalities hold with that share on the CPU's side (check_plan), and fewer
    CPU decodes ride in batch-1 than with the same tables and no share."""
    base = make_cost_model(cpu_seconds_per_token=2e-5)  # attention dear enough that the window binds
    placed = {}
    for share in (0.0, cpu_share):
        sched = make_scheduler(num_gpu_blocks=24, num_cpu_blocks=96, max_model_len=64, max_num_seqs=24,
                               cost_model=cpu_shared(base, share))
        history = run_trace(sched, seed)
        placed[share] = sum(len(plan.batch1_cpu_decodes) for plan in history if not plan.forced)
    assert placed[cpu_share] < placed[0.0]


def test_a_cpu_busy_with_its_linear_share_takes_no_batch1():
    """A share that fills batch-0's linear window leaves no room for batch-1's attention."""
    sched, _ = fill_both_tiers(cpu_shared(make_cost_model(cpu_seconds_per_token=1e-7), 1.0))
    for _ in range(5):
        plan = step(sched)
        assert not plan.batch1_cpu_decodes or plan.forced
