"""Scheduler v0 in milliseconds: plain sequences, fake runner outputs, no torch."""
import random
import subprocess
import sys

import pytest

from scheduler.block_pool import BlockPool, blocks_for
from scheduler.sampling_params import ParamError, SamplingParams
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerConfigError
from scheduler.iteration_plan import IterationPlan, PlanMode

EOS = 2


def make_sequence(seq_id, num_prompt_tokens=10, **params):
    params.setdefault("max_tokens", 8)
    return Sequence(str(seq_id), list(range(100, 100 + num_prompt_tokens)), SamplingParams(**params),
                    eos_token_ids=(EOS,))


def make_scheduler(num_blocks=64, block_size=4, max_model_len=64, **kw):
    kw.setdefault("enable_prefix_caching", False)  # these prompts share prefixes; tests/scheduler/test_prefix_cache.py covers caching
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size,
                                     max_model_len=max_model_len, **kw))


def fake_tokens(plan, token=7):
    return [token] * len(plan.sampling)


def test_scheduler_does_not_import_torch():
    code = "import sys, scheduler.scheduler, scheduler.sequence, scheduler.sampling_params; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_block_pool_check_then_act():
    pool = BlockPool(4, 16)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    assert pool.allocate(5) is None and pool.num_free_blocks == 4
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 1
    pool.free(ids)
    assert pool.num_free_blocks == 4
    assert blocks_for(16, 16) == 1 and blocks_for(17, 16) == 2 and blocks_for(0, 16) == 0


def test_prefills_and_decodes_share_an_iteration():
    sched = make_scheduler()
    first = make_sequence("a")
    sched.add_sequence(first)
    plan = sched.schedule()
    assert [s.sequence for s in plan.prefills] == [first] and not plan.decodes
    assert plan.prefills[0].num_new_tokens == 10
    sched.update(plan, fake_tokens(plan))
    second = make_sequence("b", num_prompt_tokens=5)
    sched.add_sequence(second)
    plan = sched.schedule()
    assert [s.sequence for s in plan.decodes] == [first]
    assert [s.sequence for s in plan.prefills] == [second]
    assert plan.decodes[0].num_computed_tokens == 10 and plan.decodes[0].token_ids == [7]
    assert plan.num_batched_tokens == 6


def test_limits_on_seqs_and_tokens():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_sequence(make_sequence(i, num_prompt_tokens=30))
    plan = sched.schedule()
    # 30 + 30 tokens fit the 64 budget but would need max_num_seqs >= 2: both admitted
    assert len(plan.prefills) == 2 and sched.num_waiting == 1
    sched.update(plan, fake_tokens(plan))
    plan = sched.schedule()
    assert len(plan.decodes) == 2 and not plan.prefills  # max_num_seqs reached

    sched = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        sched.add_sequence(make_sequence(i, num_prompt_tokens=30))
    plan = sched.schedule()
    # the budget's last 4 tokens go to the third prompt's first chunk, which samples nothing
    assert [(s.num_new_tokens, s.samples) for s in plan.prefills] == [(30, True), (30, True), (4, False)]
    assert plan.sampling == plan.prefills[:2]
    sched.update(plan, fake_tokens(plan))
    third = plan.prefills[2].sequence
    assert third.num_computed_tokens == 4 and not third.output_token_ids
    plan = sched.schedule()  # two decodes, then the rest of the third prompt
    assert len(plan.decodes) == 2
    assert [(s.sequence, s.num_computed_tokens, s.num_new_tokens, s.samples) for s in plan.prefills] == [
        (third, 4, 26, True)]


def test_preempts_newest_and_recomputes_with_generated_tokens():
    # 6 blocks of 4 tokens: two sequences of 10 prompt tokens take 3 blocks each
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, watermark_blocks=0)
    old, new = make_sequence("old", max_tokens=10), make_sequence("new", max_tokens=10)
    sched.add_sequence(old)
    sched.add_sequence(new)
    plan = sched.schedule()
    assert len(plan.prefills) == 2
    sched.update(plan, fake_tokens(plan))
    for _ in range(2):  # tokens 11, 12 fit in the third block
        plan = sched.schedule()
        assert not plan.preempted
        sched.update(plan, fake_tokens(plan))
    plan = sched.schedule()  # token 13 needs a 4th block each: the newest yields
    assert plan.preempted == [new]
    assert [s.sequence for s in plan.decodes] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and not new.block_ids
    assert list(sched.waiting) == [new] and new.num_output_tokens == 3
    sched.update(plan, fake_tokens(plan))
    while not old.finished:
        plan = sched.schedule()
        sched.update(plan, fake_tokens(plan))
    plan = sched.schedule()
    assert [s.sequence for s in plan.prefills] == [new]
    # recomputed: prompt + the 3 tokens it had generated
    assert plan.prefills[0].num_new_tokens == 13 and plan.prefills[0].token_ids == new.all_token_ids


def test_stop_conditions():
    sched = make_scheduler()
    eos = make_sequence("eos")
    stop = make_sequence("stop", stop_token_ids=[9])
    ignore = make_sequence("ignore", ignore_eos=True, max_tokens=2)
    late = make_sequence("late", min_tokens=2)
    for r in (eos, stop, ignore, late):
        sched.add_sequence(r)
    plan = sched.schedule()
    sched.update(plan, [EOS, 9, EOS, EOS])
    assert eos.status is SequenceStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.status is SequenceStatus.FINISHED_STOPPED and stop.stop_reason == 9
    assert not ignore.finished and not late.finished  # min_tokens keeps EOS from stopping it
    plan = sched.schedule()
    sched.update(plan, [EOS, EOS])
    assert ignore.status is SequenceStatus.FINISHED_LENGTH
    assert late.status is SequenceStatus.FINISHED_STOPPED
    assert sched.block_pool.num_free_blocks == sched.config.num_blocks


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=12)
    seq = make_sequence("r", num_prompt_tokens=10, max_tokens=None)
    sched.add_sequence(seq)
    while not seq.finished:
        plan = sched.schedule()
        sched.update(plan, fake_tokens(plan))
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 12


def test_config_validation():
    with pytest.raises(SchedulerConfigError, match="max_model_len"):
        SchedulerConfig(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(SchedulerConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=32)
    with pytest.raises(SchedulerConfigError, match="max_model_len"):
        make_scheduler(max_model_len=16).add_sequence(make_sequence("long", num_prompt_tokens=20))


def test_sampling_params_errors_name_the_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                          ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                          ({"presence_penalty": 3}, "presence_penalty"),
                          ({"logit_bias": {1: 500}}, "logit_bias"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ParamError) as info:
            SamplingParams(**kwargs)
        assert info.value.param == field


@pytest.mark.parametrize("seed", range(5))
def test_random_mix_never_loses_requests_or_blocks(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=20, block_size=4, max_model_len=40, max_num_seqs=6)
    seqs = []
    for step in range(400):
        if len(seqs) < 40 and rng.random() < 0.3:
            r = make_sequence(f"r{len(seqs)}", num_prompt_tokens=rng.randint(1, 20),
                             max_tokens=rng.randint(1, 19))
            seqs.append(r)
            sched.add_sequence(r)
        if rng.random() < 0.05:
            live = [r for r in seqs if not r.finished]
            if live:
                sched.abort_sequences([rng.choice(live).seq_id])
        plan = sched.schedule()
        used = sum(len(r.block_ids) for r in sched.running)
        assert used + sched.block_pool.num_free_blocks == sched.config.num_blocks
        assert plan.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= 6
        for s in plan.scheduled:
            assert len(s.sequence.block_ids) * 4 >= s.num_computed_tokens + s.num_new_tokens
        sched.update(plan, [rng.choice([EOS, 5, 6, 7, 8]) for _ in plan.scheduled])
    while sched.has_unfinished_sequences():
        plan = sched.schedule()
        sched.update(plan, fake_tokens(plan))
    assert all(r.finished for r in seqs)
    assert sched.block_pool.num_free_blocks == sched.config.num_blocks
    assert all(not r.block_ids for r in seqs)


def test_plan_modes_are_an_enum_whose_values_are_the_metric_labels():
    assert [mode.value for mode in PlanMode] == ["gpu_only", "pipelined"]
    assert IterationPlan().mode is PlanMode.GPU_ONLY and PlanMode("pipelined") is PlanMode.PIPELINED
    assert str(PlanMode.PIPELINED) == f"{PlanMode.PIPELINED}" == "pipelined" == PlanMode.PIPELINED
